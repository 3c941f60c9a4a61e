"""`pdqueue models`: the model families pdqueue serves, with the paths and weight formats of
each; `pdqueue models DIR` reads a checkpoint's config.json as a worker would (its family and
parts, or the field that stops it). Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import click

from workers.cli.common import UserError


@click.command()
@click.argument("directory", required=False, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def models(directory, as_json):
    """List the model families pdqueue serves, or read DIRECTORY's config.json as a worker would."""
    # (imported here: the CLI package imports every command, and the gateway and metrics-sd
    # import the CLI package without any model code)
    from pdqueue.models.families import FAMILIES, PATHS, weight_formats

    if directory is not None:
        _show_directory(directory, as_json)
        return
    rows = [{"family": f.name, "architectures": list(f.architectures), "model_types": list(f.model_types),
             "adds": f.adds, "weights": list(weight_formats(f)), "gguf": list(f.gguf), "paths": list(PATHS)}
            for f in FAMILIES]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for row in rows:
        click.echo(f"{row['family']:<10} {', '.join(row['architectures'])}")
        click.echo(f"{'':<10} {row['adds']}")
        click.echo(f"{'':<10} --weights {' | '.join(row['weights'])}; GGUF: "
                   f"{', '.join(row['gguf']) or 'no (Hugging Face directories)'}")
    click.echo(f"\nEvery family runs on every path ({', '.join(PATHS)}): the KV pool has one layout for all; "
               "tests/test_families_pipeline.py runs each family through real workers.")
    click.echo("A config field a family does not implement is refused by name: `pdqueue models DIR` checks one.")


def _show_directory(directory: Path, as_json: bool) -> None:
    from pdqueue.models.families import ConfigError, config_from_hf, family_for, weight_formats

    path = directory / "config.json"
    try:
        raw = json.loads(path.read_text())
        family = family_for(raw)
        config = config_from_hf(raw, directory.name)
    except (OSError, ValueError) as exc:   # ConfigError and JSONDecodeError are ValueErrors
        reason = str(exc) if isinstance(exc, ConfigError) else f"cannot read {path}: {exc}"
        raise UserError(f"{directory}: {reason}") from None
    if as_json:
        click.echo(json.dumps({"family": family.name, "weights": list(weight_formats(family)),
                               "config": asdict(config)}, indent=2, default=str))
        return
    window = f", sliding window {config.sliding_window} in {config.layer_types.count('sliding_attention')} " \
             f"of {config.num_layers} layers" if config.sliding_window else ""
    experts = f", {config.moe.num_experts} experts (top {config.moe.top_k})" if config.moe else ""
    click.echo(f"{directory}: {family.name} ({', '.join(raw.get('architectures') or [])}), {config.num_layers} layers, "
               f"{config.num_heads} heads / {config.num_kv_heads} KV heads of {config.head_dim}{window}{experts}, "
               f"rope {config.rope.kind} (theta {config.rope.theta:g}), context {config.max_position_embeddings}")
    kv = config.num_layers * 2 * config.num_kv_heads * config.head_dim
    click.echo(f"KV per token: {kv * 4} bytes in float32 ({kv * 2} in bfloat16); --weights "
               f"{' | '.join(weight_formats(family))}")

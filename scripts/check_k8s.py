"""pdqueue's own checks of deploy/k8s (run by scripts/check-k8s after the schema check).

- every container that runs `pdqueue ...` parses with the real command line (options that
  exist, values of the right type), without running anything;
- a pod whose /dev/shm is an emptyDir in memory and which runs a prefill worker sizes it
  to at least --kv-cache-mb + 32 Mi (the pool lives there, plus its header and the node id);
- every file kustomization.yaml lists exists.

Exit status 1 with one line per problem. Usage: python scripts/check_k8s.py DIR
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import click
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from workers.cli import cli  # noqa: E402

SHM_MARGIN_MI = 32
UNITS = {"": 1 / 2**20, "Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 1024**2,
         "k": 1e3 / 2**20, "M": 1e6 / 2**20, "G": 1e9 / 2**20}


def mebibytes(quantity: str) -> float:
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(quantity))
    if not m or m.group(2) not in UNITS:
        raise ValueError(f"cannot read the quantity {quantity!r}")
    return float(m.group(1)) * UNITS[m.group(2)]


def parse_pdqueue(args: list[str]) -> dict:
    """The parameters `pdqueue ARGS` would run with (click parses, nothing runs)."""
    parent = click.Context(cli, info_name="pdqueue")
    cmd, rest, name = cli, list(args), "pdqueue"
    while isinstance(cmd, click.Group):
        if not rest:
            raise click.UsageError(f"`{name}` needs a command")
        name = rest.pop(0)
        sub = cmd.get_command(parent, name)
        if sub is None:
            raise click.UsageError(f"no such command {name!r}")
        if isinstance(sub, click.Group):
            parent = click.Context(sub, info_name=name, parent=parent)
        cmd = sub
    return cmd.make_context(name, rest, parent=parent).params


def pod_specs(doc: dict):
    spec = doc.get("spec") or {}
    if doc.get("kind") in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        yield spec["template"]["spec"]
    elif doc.get("kind") == "Pod":
        yield spec


def check_pod(where: str, pod: dict) -> list[str]:
    problems = []
    shm_limits = {}
    for vol in pod.get("volumes", []):
        empty = vol.get("emptyDir")
        if empty is not None and empty.get("medium") == "Memory":
            shm_limits[vol["name"]] = empty.get("sizeLimit")
    for c in pod.get("containers", []):
        argv = list(c.get("command") or []) + list(c.get("args") or [])
        if not argv or argv[0] != "pdqueue":
            continue
        try:
            params = parse_pdqueue(argv[1:])
        except click.ClickException as exc:
            problems.append(f"{where}: container {c['name']}: `{' '.join(argv)}`: {exc.format_message()}")
            continue
        except click.exceptions.Exit:
            continue
        if params.get("role") != "prefill":
            continue
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        shm = mounts.get("/dev/shm")
        if shm not in shm_limits:
            problems.append(f"{where}: prefill container {c['name']} has no emptyDir (medium Memory) at /dev/shm")
            continue
        need = params["kv_cache_mb"] + SHM_MARGIN_MI
        have = shm_limits[shm]
        if have is None or mebibytes(have) < need:
            problems.append(f"{where}: prefill container {c['name']}: /dev/shm sizeLimit {have} is under "
                            f"--kv-cache-mb {params['kv_cache_mb']} + {SHM_MARGIN_MI}Mi")
    return problems


def main(directory: str) -> int:
    root = Path(directory)
    problems = []
    for path in sorted(root.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            listed = yaml.safe_load(path.read_text()).get("resources", [])
            problems += [f"{path}: lists {name}, which does not exist" for name in listed
                         if not (root / name).exists()]
            continue
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if not doc:
                continue
            where = f"{path} ({doc.get('kind')} {doc.get('metadata', {}).get('name')})"
            for pod in pod_specs(doc):
                problems += check_pod(where, pod)
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "deploy" / "k8s")))

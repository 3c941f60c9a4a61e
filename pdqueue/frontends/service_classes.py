"""Service classes of the front ends' requests: ``interactive``, ``standard``, ``batch``.

``class_fields`` is the one place a class becomes request fields. Until the request carries
a class of its own (issue 27's worker side), ``interactive`` is today's high priority
(``requests:high``, read first at intake) and the other two the normal stream."""

from __future__ import annotations

__all__ = ["BATCH", "INTERACTIVE", "SERVICE_CLASSES", "STANDARD", "class_fields"]

INTERACTIVE, STANDARD, BATCH = "interactive", "standard", "batch"
SERVICE_CLASSES = (INTERACTIVE, STANDARD, BATCH)


def class_fields(service_class: str) -> dict:
    """``build_request``/``submit`` arguments that put a request in ``service_class``."""
    if service_class not in SERVICE_CLASSES:
        raise ValueError(f"service class {service_class!r}: expected one of {', '.join(SERVICE_CLASSES)}")
    return {"priority": "high"} if service_class == INTERACTIVE else {}

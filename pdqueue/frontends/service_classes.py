"""Service classes of the front ends' requests: ``interactive``, ``standard``, ``batch``.

``class_fields`` is the one place a class becomes request fields: the request's ``class``,
which also picks its stream (``Keys.request_stream_for``: ``requests:high``, ``requests``,
``requests:batch``); ``interactive`` keeps ``priority=high`` too, which is what a worker older
than the field reads. workers/admission.py says how each class is admitted."""

from __future__ import annotations

__all__ = ["BATCH", "INTERACTIVE", "SERVICE_CLASSES", "STANDARD", "class_fields"]

INTERACTIVE, STANDARD, BATCH = "interactive", "standard", "batch"
SERVICE_CLASSES = (INTERACTIVE, STANDARD, BATCH)


def class_fields(service_class: str) -> dict:
    """``build_request``/``submit`` arguments that put a request in ``service_class``."""
    if service_class not in SERVICE_CLASSES:
        raise ValueError(f"service class {service_class!r}: expected one of {', '.join(SERVICE_CLASSES)}")
    fields = {"service_class": service_class}
    if service_class == INTERACTIVE:
        fields["priority"] = "high"
    return fields

"""Service classes as the front ends name them: the protocol's table (pdqueue/protocol/classes.py,
``ServiceClass``), seen from a tenant's settings and the submit arguments.

``class_fields`` is the one place a class becomes request fields: the request's ``class``,
which also picks its stream (``Keys.request_stream_for``), and the class's ``priority`` when
that is not the default (interactive's ``high``), which is what a worker older than the
``class`` field reads. workers/admission.py says how a class that yields is admitted."""

from __future__ import annotations

from pdqueue.protocol import Priority, ServiceClass

__all__ = ["BATCH", "INTERACTIVE", "SERVICE_CLASSES", "STANDARD", "class_fields"]

SERVICE_CLASSES = ServiceClass.names()
INTERACTIVE, STANDARD, BATCH = (ServiceClass.INTERACTIVE.value, ServiceClass.STANDARD.value,
                                ServiceClass.BATCH.value)


def class_fields(service_class: str) -> dict:
    """``build_request``/``submit`` arguments that put a request in ``service_class``."""
    if service_class not in SERVICE_CLASSES:
        raise ValueError(f"service class {service_class!r}: expected one of {', '.join(SERVICE_CLASSES)}")
    cls = ServiceClass(service_class)
    fields = {"service_class": cls.value}
    if cls.priority not in (None, Priority.NORMAL):
        fields["priority"] = cls.priority.value
    return fields

"""The OpenAI front ends, producers of the queue like any other client (none imports torch):
`openai_compat` (the API as pure functions); the gateway, `pdqueue serve` (`gateway`: the
app and its stop; `answer`, `resumable`, `cluster_view`, `gateway_metrics`, `http_errors`,
`runtime`, `tenants`, `service_classes`; the Batch API: `batch_api`, `batch_store`, `batch_runner`); OpenAI
Batch files, `pdqueue batch` (`batch`: the window; `batch_input`, `batch_output`,
`batch_resume`)."""

"""The OpenAI front ends: `openai_compat` (the API as pure functions), `gateway` (the HTTP
server, `pdqueue serve`) and `batch` (OpenAI Batch files, `pdqueue batch`). Producers of
the queue like any other client; none imports torch."""

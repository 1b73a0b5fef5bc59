"""specd's OpenAI-compatible HTTP gateway (Litestar): validates requests, queues them for
the workers through Redis/RQ and streams their events back. Imports only worker.protocol
(and worker.errors) from the worker package: no numpy, no native module."""

"""OpenAI's client API on the wire, shared by the gateway's client routes and a worker's OpenAI routes.

`errors` (the error body and the errors that carry one), `fields` (typed reads of a JSON body),
`chat` (messages, and the default chat template as plain Python), `requests` (completion, chat and
SGLang /generate bodies checked against `Bounds`) and `envelopes` (SSE framing, response bodies and
stream chunks). Pure: no I/O, no Config; each side states its limits in a `Bounds`.
"""

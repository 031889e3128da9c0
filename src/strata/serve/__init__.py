"""`strata serve`: an OpenAI-compatible HTTP server on one `Engine`.

How the parts fit, in the order a request meets them:

    server      uvicorn, and a clean shutdown on SIGTERM
    app         the FastAPI app: routes, the API key, what the engine thread records
    access_log  one log line per request, and its count in the metrics
    schemas     request and response bodies as typed models (the OpenAI API's shapes)
    errors      every failure as an OpenAI-style error body
    prompts     a request checked and turned into prompt ids and generation options
    replies     a request through the engine thread, answered whole or streamed (SSE)
    shapes      chat and text completions, whole or as chunks
    jobs        one request between the event loop and the engine thread; stops, the bridge
    stops       stop strings cut from the text as it comes
    worker      the one thread that owns the engine, and the bounded queue in front of it
    status      what /v1/status shows; metrics: what /metrics shows
    options     ServeOptions (how it listens and admits), ServedModel (what it serves)

HTTP is served by an asyncio event loop; the engine, which runs one request at a time and is
not thread-safe, by one thread of its own. Requests wait for it in arrival order in a bounded
queue. This room imports the engine and the policies' events, never the command line:
`strata.cli.serve` builds the options and the loader from the flags and calls `serve`.
"""

from strata.serve.options import ServedModel, ServeOptions

__all__ = ["ServeOptions", "ServedModel"]

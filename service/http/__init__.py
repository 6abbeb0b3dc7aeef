"""The HTTP front end: the REST routes over any core (`routes.rest_router`, one module per
concern, on a `service.core.api.CoreAPI`), the app every deployment builds on them
(`rest_app.create_rest_app`), the single-process app over a `ServerCore`
(`app.create_app`), response bodies (`responses`), OpenAPI pieces, middleware, problem
details, body reading, the uvicorn protocol it runs on, and the container health probe."""

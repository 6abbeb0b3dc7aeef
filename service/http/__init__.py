"""The HTTP front end: the FastAPI app over a `ServerCore` (`app.create_app`), its middleware,
problem details, body reading, the uvicorn protocol it runs on, and the container
health probe."""

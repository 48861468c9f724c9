"""An event receiver for tests/it/events.rs as many are deployed: a plain WSGI
app under gunicorn at its defaults (one sync worker: one request at a time,
the rest wait in the listen queue; idle keep-alive connections closed after
2 s). Each delivery takes 50 ms of work, then answers 200. POST /hook records
the event's `Idemgate-Event-Id`; GET /received lists every id received, in
order (one worker process, so one list)."""

import json
import time

received = []


def app(environ, start_response):
    if environ["REQUEST_METHOD"] == "POST" and environ["PATH_INFO"] == "/hook":
        length = int(environ.get("CONTENT_LENGTH") or 0)
        environ["wsgi.input"].read(length)
        received.append(environ.get("HTTP_IDEMGATE_EVENT_ID", ""))
        time.sleep(0.05)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]
    if environ["REQUEST_METHOD"] == "GET" and environ["PATH_INFO"] == "/received":
        body = json.dumps(received).encode()
        start_response("200 OK", [("Content-Type", "application/json")])
        return [body]
    start_response("404 Not Found", [("Content-Type", "text/plain")])
    return [b"not found"]

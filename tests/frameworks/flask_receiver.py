"""An event receiver for tests/it/events.rs as Flask's documentation writes a
route: `@app.post("/hook/")`, with a trailing slash. Flask at its defaults
(`strict_slashes`) answers a POST to `/hook` with 308 Permanent Redirect to
`/hook/`. POST /hook/ records the event's id; GET /received lists them. Served
by the standard library's WSGI server; prints "listening <port>" once it
serves."""

import json
import sys
from wsgiref.simple_server import WSGIRequestHandler, make_server

from flask import Flask, request

app = Flask(__name__)
received = []


@app.post("/hook/")
def hook():
    body = request.get_json()
    events = body["events"] if isinstance(body, dict) and "events" in body else [body]
    received.extend(event["id"] for event in events)
    return "ok"


@app.get("/received")
def listing():
    return app.response_class(json.dumps(received), mimetype="application/json")


class Quiet(WSGIRequestHandler):
    def log_message(self, *args):
        pass


if __name__ == "__main__":
    server = make_server("127.0.0.1", 0, app.wsgi_app, handler_class=Quiet)
    print(f"listening {server.server_port}", flush=True)
    sys.stdout.close()
    server.serve_forever()

"""A Flask upstream for tests/it/frameworks.rs, served by the standard library's
WSGI server (wsgiref: like gunicorn or uWSGI it folds `X_Tenant_Id` and
`X-Tenant-Id` into one HTTP_X_TENANT_ID). It wears the method-override
middleware of Flask's documentation (X-HTTP-Method-Override), and Flask runs
a GET view for HEAD. Every view records what it dispatched; GET /__dispatched
lists the records. Prints "listening <port>" once it serves."""

import json
import sys
from wsgiref.simple_server import WSGIRequestHandler, make_server

from flask import Flask, jsonify, request

app = Flask(__name__)
dispatched = []


class HTTPMethodOverrideMiddleware:
    """Flask's documented pattern: the method from X-HTTP-Method-Override."""

    allowed_methods = frozenset(["GET", "HEAD", "POST", "DELETE", "PUT", "PATCH", "OPTIONS"])
    bodyless_methods = frozenset(["GET", "HEAD", "OPTIONS", "DELETE"])

    def __init__(self, wsgi_app):
        self.app = wsgi_app

    def __call__(self, environ, start_response):
        method = environ.get("HTTP_X_HTTP_METHOD_OVERRIDE", "").upper()
        if method in self.allowed_methods:
            environ["REQUEST_METHOD"] = method
        if method in self.bodyless_methods:
            environ["CONTENT_LENGTH"] = "0"
        return self.app(environ, start_response)


def record(handler):
    env = request.environ
    dispatched.append(
        {
            "handler": handler,
            "method": request.method,
            "path": request.path,
            "tenant": env.get("HTTP_X_TENANT_ID"),
            "principal": env.get("HTTP_X_PRINCIPAL_ID"),
            "key": env.get("HTTP_IDEMPOTENCY_KEY"),
            "generation": env.get("HTTP_X_IDEMPOTENCY_GENERATION"),
        }
    )
    return jsonify({"handler": handler}), (200 if request.method in ("GET", "HEAD") else 201)


@app.route("/v1/orders", methods=["POST"])
def create_order():
    return record("create_order")


@app.route("/v1/orders/all", methods=["PUT"])
def replace_all():
    return record("replace_all")


@app.route("/v1/orders/<order>", methods=["PUT"])
def replace_order(order):
    return record("replace_order")


@app.route("/v1/orders/<order>", methods=["DELETE"])
def delete_order(order):
    return record("delete_order")


@app.route("/v1/orders/<order>", methods=["GET", "PATCH"])
def other_order(order):
    return record("other_order")


@app.route("/v1/orders/all/cancel", methods=["POST"])
def cancel_all():
    return record("cancel_all")


@app.route("/v1/orders/<order>/cancel", methods=["POST"])
def cancel_order(order):
    return record("cancel_order")


@app.route("/v1/reports/<report>", methods=["GET"])
def read_report(report):
    return record("read_report")


@app.route("/v1/elsewhere", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
def elsewhere():
    return record("elsewhere")


@app.route("/__dispatched", methods=["GET"])
def listing():
    since = int(request.args.get("since", "0"))
    return app.response_class(json.dumps(dispatched[since:]), mimetype="application/json")


class Quiet(WSGIRequestHandler):
    def log_message(self, *args):
        pass


if __name__ == "__main__":
    server = make_server("127.0.0.1", 0, HTTPMethodOverrideMiddleware(app.wsgi_app), handler_class=Quiet)
    print(f"listening {server.server_port}", flush=True)
    sys.stdout.close()
    server.serve_forever()

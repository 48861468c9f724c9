// An Express upstream for tests/it/frameworks.rs, with method-override from npm
// as its README shows it: the X-HTTP-Method-Override, X-HTTP-Method and
// X-Method-Override headers, `_method` in the query, and `_method` in an
// urlencoded body. Express routes without regard to letter case or a
// trailing slash and runs a GET handler for HEAD. Every handler records what
// it dispatched; GET /__dispatched lists the records. Prints
// "listening <port>" once it serves.
'use strict';
const express = require('express');
const methodOverride = require('method-override');

const app = express();
const dispatched = [];

app.use(methodOverride('X-HTTP-Method-Override'));
app.use(methodOverride('X-HTTP-Method'));
app.use(methodOverride('X-Method-Override'));
app.use(methodOverride('_method'));
app.use(express.urlencoded({ extended: false }));
app.use(methodOverride(function (req) {
  if (req.body && typeof req.body === 'object' && '_method' in req.body) {
    const method = req.body._method;
    delete req.body._method;
    return method;
  }
}));

function record(handler) {
  return function (req, res) {
    dispatched.push({
      handler: handler,
      method: req.method,
      path: req.path,
      tenant: req.get('x-tenant-id') || null,
      principal: req.get('x-principal-id') || null,
      key: req.get('idempotency-key') || null,
      generation: req.get('x-idempotency-generation') || null,
    });
    res.status(req.method === 'GET' || req.method === 'HEAD' ? 200 : 201).json({ handler: handler });
  };
}

app.post('/v1/orders', record('create_order'));
// Literal routes before the parameters beside them: Express runs the first
// that matches, letter case ignored.
app.put('/v1/orders/all', record('replace_all'));
app.put('/v1/orders/:order', record('replace_order'));
app.delete('/v1/orders/:order', record('delete_order'));
app.get('/v1/orders/:order', record('other_order'));
app.patch('/v1/orders/:order', record('other_order'));
app.post('/v1/orders/all/cancel', record('cancel_all'));
app.post('/v1/orders/:order/cancel', record('cancel_order'));
app.get('/v1/reports/:report', record('read_report'));
app.all('/v1/elsewhere', record('elsewhere'));
app.get('/__dispatched', function (req, res) { res.json(dispatched.slice(Number(req.query.since || 0))); });

const server = app.listen(0, '127.0.0.1', function () {
  process.stdout.write('listening ' + server.address().port + '\n');
});

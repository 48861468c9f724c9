// An event receiver for tests/it/events.rs as Express documents one: JSON
// bodies parsed by express.json() at its defaults (at most 100 kB a body;
// a larger one is answered 413 by Express's own error handler). POST /hook
// records the ids of the events it parsed (one event, or a batch's
// {"events": [...]}); every POST's status and size are recorded too.
// GET /received answers {"ids": [...], "posts": [[status, bytes], ...]}.
// The test's own switch, in front of the parser: POST /__close makes /hook
// answer 503 with Retry-After: 2 (the receiver down for maintenance) until
// POST /__open. Listens on any free port; prints "listening <port>" once it
// serves.
'use strict';
const express = require('express');

const app = express();
const ids = [];
const posts = [];
let closed = false;

app.post('/__close', function (req, res) { closed = true; res.send('closed'); });
app.post('/__open', function (req, res) { closed = false; res.send('open'); });

app.use('/hook', function (req, res, next) {
  const bytes = Number(req.get('content-length') || 0);
  res.on('finish', function () { posts.push([res.statusCode, bytes]); });
  if (closed) {
    res.status(503).set('Retry-After', '2').send('closed for maintenance');
    return;
  }
  next();
});

app.post('/hook', express.json(), function (req, res) {
  const events = Array.isArray(req.body.events) ? req.body.events : [req.body];
  for (const event of events) {
    ids.push(event.id);
  }
  res.status(200).send('ok');
});

app.get('/received', function (req, res) { res.json({ ids: ids, posts: posts }); });

const server = app.listen(0, '127.0.0.1', function () {
  process.stdout.write('listening ' + server.address().port + '\n');
});

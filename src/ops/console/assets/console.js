// idemgate operator console. No dependencies, no build step.
//
// Safety rules this file keeps (stored records are attacker-controlled):
// - every value from the API is inserted with textContent / text nodes, never
//   as HTML;
// - no link or URL is built from a stored value: records are opened by click
//   handlers, and API paths percent-encode every segment;
// - the token lives in this tab's sessionStorage only and is sent as a Bearer
//   header; fetch never sends cookies (credentials: 'omit').
'use strict';

(function () {
  const TOKEN_KEY = 'idemgate.console.token';
  const REFRESH_MS = 5000;
  let refreshTimer = null;

  // ---------- DOM helpers: text only ----------

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === 'class') node.className = v;
      else if (k === 'onclick') node.addEventListener('click', v);
      else if (k === 'onchange') node.addEventListener('change', v);
      else if (k === 'text') node.textContent = String(v);
      else node.setAttribute(k, v === true ? '' : String(v));
    }
    for (const c of children.flat()) {
      if (c === undefined || c === null || c === false) continue;
      node.appendChild(typeof c === 'object' ? c : document.createTextNode(String(c)));
    }
    return node;
  }

  function text(v) {
    if (v === undefined || v === null) return '—';
    return String(v);
  }

  function clear(node) {
    while (node.firstChild) node.removeChild(node.firstChild);
  }

  function view() {
    return document.getElementById('view');
  }

  function dl(pairs) {
    const list = el('dl', { class: 'fields' });
    for (const [k, v] of pairs) {
      list.appendChild(el('dt', {}, k));
      list.appendChild(el('dd', {}, typeof v === 'object' && v !== null ? v : text(v)));
    }
    return list;
  }

  function table(headers, rows, cls) {
    const t = el('table', { class: cls || '' });
    t.appendChild(el('thead', {}, el('tr', {}, headers.map((h) => el('th', {}, h)))));
    const body = el('tbody');
    for (const r of rows) body.appendChild(r);
    if (rows.length === 0) body.appendChild(el('tr', {}, el('td', { colspan: String(headers.length), class: 'empty' }, 'none')));
    t.appendChild(body);
    return t;
  }

  function row(cells, props) {
    return el('tr', props || {}, cells.map((c) => el('td', {}, typeof c === 'object' && c !== null ? c : text(c))));
  }

  function age(seconds) {
    if (seconds === undefined || seconds === null) return '—';
    const s = Math.floor(seconds);
    if (s < 120) return s + ' s';
    if (s < 7200) return Math.floor(s / 60) + ' min';
    if (s < 172800) return Math.floor(s / 3600) + ' h';
    return Math.floor(s / 86400) + ' d';
  }

  function problemBox(err) {
    const box = el('div', { class: 'error', role: 'alert', id: 'problem' });
    if (err && err.problem) {
      box.appendChild(el('strong', {}, text(err.problem.title) + ' (' + text(err.problem.status) + ')'));
      box.appendChild(el('p', {}, text(err.problem.detail)));
    } else {
      box.appendChild(el('strong', {}, 'Request failed'));
      box.appendChild(el('p', {}, text(err && err.message)));
    }
    return box;
  }

  // ---------- API ----------

  class ApiError extends Error {
    constructor(status, problem) {
      super(problem && problem.detail ? problem.detail : 'HTTP ' + status);
      this.status = status;
      this.problem = problem;
    }
  }

  function token() {
    return sessionStorage.getItem(TOKEN_KEY);
  }

  function seg(s) {
    return encodeURIComponent(s);
  }

  function scopePath(s) {
    return seg(s.tenant) + '/' + seg(s.principal) + '/' + seg(s.operation) + '/' + seg(s.key);
  }

  async function api(method, path, body) {
    const headers = { Authorization: 'Bearer ' + token(), 'X-Idemgate-Actor': 'console' };
    if (body !== undefined) headers['Content-Type'] = 'application/json';
    const resp = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      credentials: 'omit',
      cache: 'no-store',
      redirect: 'error',
    });
    let doc = null;
    try {
      doc = await resp.json();
    } catch (e) {
      doc = null;
    }
    if (!resp.ok) {
      if (resp.status === 401) {
        sessionStorage.removeItem(TOKEN_KEY);
        showLogin('The token was refused (401): ' + text(doc && doc.detail));
      }
      throw new ApiError(resp.status, doc);
    }
    return doc;
  }

  // ---------- login ----------

  function showLogin(message) {
    stopRefresh();
    document.getElementById('nav').hidden = true;
    document.getElementById('login').hidden = false;
    clear(view());
    document.getElementById('login-error').textContent = message || '';
    document.getElementById('token').focus();
  }

  async function logIn() {
    const input = document.getElementById('token');
    const value = input.value.trim();
    input.value = '';
    if (!value) {
      document.getElementById('login-error').textContent = 'Enter the admin token.';
      return;
    }
    sessionStorage.setItem(TOKEN_KEY, value);
    try {
      await api('GET', '/admin/overview');
    } catch (e) {
      if (e.status !== 401) {
        sessionStorage.removeItem(TOKEN_KEY);
        showLogin('Could not log in: ' + e.message);
      }
      return;
    }
    document.getElementById('login').hidden = true;
    document.getElementById('nav').hidden = false;
    if (!location.hash || location.hash === '#' || location.hash === '#/login') location.hash = '#/overview';
    else route();
  }

  function logOut() {
    sessionStorage.removeItem(TOKEN_KEY);
    showLogin('Logged out.');
  }

  // ---------- routing ----------

  function stopRefresh() {
    if (refreshTimer !== null) {
      clearTimeout(refreshTimer);
      refreshTimer = null;
    }
  }

  function parseHash() {
    const h = location.hash.replace(/^#\/?/, '');
    const q = h.indexOf('?');
    const path = q < 0 ? h : h.slice(0, q);
    const params = new URLSearchParams(q < 0 ? '' : h.slice(q + 1));
    const decode = (s) => {
      try {
        return decodeURIComponent(s);
      } catch (e) {
        return s;
      }
    };
    return { parts: path.split('/').map(decode), params };
  }

  async function route() {
    stopRefresh();
    if (!token()) return showLogin('');
    document.getElementById('login').hidden = true;
    document.getElementById('nav').hidden = false;
    const { parts, params } = parseHash();
    for (const a of document.querySelectorAll('nav a')) a.classList.remove('current');
    const current = document.getElementById('nav-' + (parts[0] === 'record' ? 'records' : parts[0]));
    if (current) current.classList.add('current');
    try {
      switch (parts[0]) {
        case 'records':
          return await records(params);
        case 'record':
          if (parts.length === 5) return await record({ tenant: parts[1], principal: parts[2], operation: parts[3], key: parts[4] });
          break;
        case 'events':
          return await events();
        case 'audit':
          return await audit();
        default:
          return await overview();
      }
      return await overview();
    } catch (e) {
      if (e.status === 401) return;
      const v = view();
      clear(v);
      v.appendChild(problemBox(e));
    }
  }

  function go(hash) {
    if (location.hash === hash) route();
    else location.hash = hash;
  }

  function openRecord(scope) {
    go('#/record/' + scopePath(scope));
  }

  // ---------- overview ----------

  async function overview() {
    const doc = await api('GET', '/admin/overview');
    const v = view();
    clear(v);
    v.appendChild(el('h1', {}, 'Overview'));
    v.appendChild(el('p', { class: 'muted' }, 'Store clock ' + text(doc.now) + '; refreshes every ' + REFRESH_MS / 1000 + ' s.'));

    const tiles = el('div', { class: 'tiles' });
    for (const [state, n] of Object.entries(doc.totals)) {
      const tile = el('button', { type: 'button', class: n > 0 ? 'tile state-' + state : 'tile zero', id: 'total-' + state, onclick: () => go('#/records?state=' + seg(state)) },
        el('span', { class: 'n' }, text(n)), el('span', { class: 'label' }, state));
      tiles.appendChild(tile);
    }
    v.appendChild(tiles);

    v.appendChild(el('h2', {}, 'Records by operation and state'));
    v.appendChild(el('p', { class: 'muted' }, 'Every state but completed, as the idemgate_records gauge counts them.'));
    v.appendChild(table(['Operation', 'State', 'Count', 'Oldest'], doc.records.map((r) =>
      row([r.operation, el('span', { class: 'state state-' + r.state }, r.state), r.count, age(r.oldest_age_seconds)]))));

    const cols = el('div', { class: 'columns' });
    const backlog = el('div', {}, el('h2', {}, 'Unknown backlog by age'),
      table(['Unknown for', 'Records'], doc.unknown_by_age.map((b) => row([b.age, b.count])), 'narrow'));
    cols.appendChild(backlog);
    cols.appendChild(el('div', {}, el('h2', {}, 'Async queue'), dl([
      ['Queued', doc.async.queued],
      ['Processing', doc.async.processing],
      ['Oldest queued', age(doc.async.oldest_queued_age_seconds)],
      ['Oldest processing', age(doc.async.oldest_processing_age_seconds)],
    ])));
    cols.appendChild(el('div', {}, el('h2', {}, 'Events'), dl([
      ['Pending', doc.events.pending],
      ['Parked', doc.events.parked],
      ['Held behind parked', doc.events.held],
      ['Oldest pending', age(doc.events.oldest_pending_age_seconds)],
    ])));
    cols.appendChild(el('div', {}, el('h2', {}, 'This replica since start'), dl([
      ['Refused reloads', doc.this_replica.refused_reloads],
      ['Fenced writes', doc.this_replica.fenced_writes],
    ])));
    v.appendChild(cols);
    v.appendChild(el('h2', {}, 'Upstream limits (this replica)'));
    v.appendChild(el('p', { class: 'muted' }, 'Requests over a limit are refused before their claim (503 overloaded).'));
    v.appendChild(table(['Upstream', 'Limit', 'In flight', 'Refused since start'], doc.upstreams.map((u) =>
      row([u.upstream, u.limit === null ? 'none' : u.limit, u.in_flight, u.refusals])), 'narrow'));
    refreshTimer = setTimeout(() => { if (parseHash().parts[0] === 'overview' || parseHash().parts[0] === '') route(); }, REFRESH_MS);
  }

  // ---------- records ----------

  const STATES = ['', 'unknown', 'in_flight', 'queued', 'processing', 'failed_retryable', 'completed'];

  async function records(params) {
    const q = new URLSearchParams();
    for (const name of ['state', 'tenant', 'operation', 'key_prefix', 'older_than', 'cursor']) {
      const value = params.get(name);
      if (value) q.set(name, value);
    }
    q.set('limit', '50');
    const doc = await api('GET', '/admin/records?' + q.toString());
    const v = view();
    clear(v);
    v.appendChild(el('h1', {}, 'Records'));

    const stateSel = el('select', { id: 'f-state' }, STATES.map((s) => el('option', { value: s, selected: params.get('state') === s || (!params.get('state') && s === '') }, s || 'any state')));
    const input = (id, name, placeholder) => el('input', { id, type: 'text', value: params.get(name) || '', placeholder, spellcheck: 'false' });
    const fOp = input('f-operation', 'operation', 'operation');
    const fTenant = input('f-tenant', 'tenant', 'tenant');
    const fPrefix = input('f-key-prefix', 'key_prefix', 'key prefix');
    const fAge = input('f-older-than', 'older_than', 'older than (e.g. 10m)');
    const apply = () => {
      const p = new URLSearchParams();
      if (stateSel.value) p.set('state', stateSel.value);
      if (fOp.value.trim()) p.set('operation', fOp.value.trim());
      if (fTenant.value.trim()) p.set('tenant', fTenant.value.trim());
      if (fPrefix.value.trim()) p.set('key_prefix', fPrefix.value.trim());
      if (fAge.value.trim()) p.set('older_than', fAge.value.trim());
      go('#/records?' + p.toString());
    };
    v.appendChild(el('div', { class: 'filters' }, stateSel, fOp, fTenant, fPrefix, fAge,
      el('button', { type: 'button', id: 'f-apply', onclick: apply }, 'Filter')));

    const rows = doc.records.map((r) => {
      const tr = row([
        el('span', { class: 'state state-' + r.state }, r.state),
        r.tenant, r.principal || '(tenant-wide)', r.operation, el('code', {}, r.key), r.generation, r.updated_at,
        el('button', { type: 'button', class: 'open', onclick: () => openRecord(r) }, 'Open'),
      ], { class: 'record-row' });
      return tr;
    });
    v.appendChild(table(['State', 'Tenant', 'Principal', 'Operation', 'Key', 'Gen', 'Updated', ''], rows, 'records'));
    if (doc.next_cursor) {
      const next = new URLSearchParams(params);
      next.set('cursor', doc.next_cursor);
      v.appendChild(el('button', { type: 'button', id: 'next-page', onclick: () => go('#/records?' + next.toString()) }, 'Next page'));
    }
    if (params.get('cursor')) {
      const first = new URLSearchParams(params);
      first.delete('cursor');
      v.appendChild(el('button', { type: 'button', id: 'first-page', onclick: () => go('#/records?' + first.toString()) }, 'First page'));
    }
  }

  // ---------- one record ----------

  function headersTable(headers, id) {
    const t = table(['Header', 'Value'], (headers || []).map(([n, val]) => row([n, el('code', {}, val)])), 'headers');
    if (id) t.id = id;
    return t;
  }

  async function record(scope) {
    const doc = await api('GET', '/admin/records/' + scopePath(scope) + '/inspect');
    const r = doc.record;
    const v = view();
    clear(v);
    v.appendChild(el('h1', {}, 'Record ', el('span', { class: 'state state-' + r.state, id: 'record-state' }, r.state)));

    v.appendChild(el('h2', {}, 'Scope'));
    v.appendChild(dl([
      ['Tenant', el('code', { id: 'scope-tenant' }, r.tenant)],
      ['Principal', el('code', {}, r.principal === '' ? '(tenant-wide)' : r.principal)],
      ['Operation', el('code', {}, r.operation)],
      ['Key', el('code', { id: 'scope-key' }, r.key)],
      ['Scope id', el('code', {}, r.scope_id)],
      ['Derived key', el('code', {}, r.derived_key)],
      ['Key source', r.key_source],
    ]));

    v.appendChild(el('h2', {}, 'State'));
    v.appendChild(dl([
      ['State', r.state],
      ['Generation', el('span', { id: 'record-generation' }, text(r.generation))],
      ['Owner', r.owner],
      ['Created', r.created_at],
      ['Updated', r.updated_at],
      ['Lease until', r.lease_expires_at === null ? '—' : r.lease_expires_at + (doc.lease_left_seconds > 0 ? ' (' + age(doc.lease_left_seconds) + ' left)' : ' (expired)')],
      ['Expires', r.expires_at],
      ['Operation id', r.operation_id],
      ['Attempts', doc.attempts],
      ['Sent at', doc.sent_at_shown],
      ['Next attempt', doc.next_attempt_at],
      ['Last upstream status', doc.last_status],
      ['May have executed', el('span', { id: 'may-have-executed' }, doc.may_have_executed)],
      ['Probe attempts', el('span', { id: 'probe-attempts' }, text(doc.probe.attempts))],
      ['Next probe', doc.probe.next_probe_at],
      ['Last probe answer', el('span', { id: 'probe-last' }, text(doc.probe.last_answer))],
    ]));

    v.appendChild(el('h2', {}, 'Stored request'));
    if (!doc.request) {
      v.appendChild(el('p', { class: 'muted' }, 'Not stored (synchronous routes keep the request line only when their probe needs path parameters).'));
    } else if (doc.request.error) {
      v.appendChild(el('p', { class: 'error' }, doc.request.error));
    } else {
      v.appendChild(dl([['Method', doc.request.method], ['Path', el('code', { id: 'request-path' }, doc.request.path)], ['Body', doc.request.body_bytes + ' bytes (not shown)']]));
      if (doc.request.headers_stored) v.appendChild(headersTable(doc.request.headers, 'request-headers'));
      v.appendChild(el('p', { class: 'muted' }, 'Credential headers are masked.'));
    }

    v.appendChild(el('h2', {}, 'Response'));
    if (!r.response) {
      v.appendChild(el('p', { class: 'muted' }, 'No response recorded.'));
    } else {
      v.appendChild(dl([['Status', el('span', { id: 'response-status' }, text(r.response.status))]]));
      v.appendChild(headersTable(r.response.headers, 'response-headers'));
      const b = r.response.body;
      let shown;
      if (!b) shown = '(body not stored: larger than max_stored_response)';
      else if (b.text !== undefined) shown = b.text;
      else shown = '(not UTF-8; base64) ' + b.base64;
      v.appendChild(el('pre', { class: 'body', id: 'response-body' }, shown));
      if (b && b.truncated) v.appendChild(el('p', { class: 'muted' }, 'Cut at ' + shown.length + ' of ' + b.bytes + ' bytes.'));
    }

    if (r.state === 'unknown' || r.state === 'in_flight') v.appendChild(resolvePanel(scope, r));

    v.appendChild(el('h2', {}, 'Audit trail'));
    v.appendChild(auditTable(doc.audit, 'record-audit'));
  }

  function auditTable(entries, id) {
    const t = table(['At', 'Actor', 'Token', 'Peer', 'From', 'To', 'Reason'], entries.map((a) =>
      row([a.at, a.actor, a.token, a.peer, a.from_state, a.to_state, (a.forced ? '[forced] ' : '') + a.reason])), 'audit');
    t.id = id;
    return t;
  }

  // ---------- resolve ----------

  function resolvePanel(scope, r) {
    const panel = el('section', { class: 'resolve', id: 'resolve' });
    panel.appendChild(el('h2', {}, 'Resolve'));
    panel.appendChild(el('p', {}, r.state === 'unknown'
      ? 'The upstream may or may not have executed this request. Find out (its own records, logs), then record what happened.'
      : 'This attempt is in flight; only an expired one may be resolved.'));
    const complete = el('input', { type: 'radio', name: 'action', id: 'action-complete', value: 'complete', checked: true });
    const release = el('input', { type: 'radio', name: 'action', id: 'action-release', value: 'release' });
    const status = el('input', { type: 'number', id: 'resolve-status', min: '200', max: '599', value: '201' });
    const headers = el('textarea', { id: 'resolve-headers', rows: '3', spellcheck: 'false', placeholder: 'content-type: application/json' });
    headers.value = 'content-type: application/json';
    const body = el('textarea', { id: 'resolve-body', rows: '4', spellcheck: 'false', placeholder: 'the response body to replay' });
    const reason = el('input', { type: 'text', id: 'resolve-reason', placeholder: 'why (kept in the audit trail)', spellcheck: 'false' });
    const completeFields = el('div', { id: 'complete-fields' },
      el('label', { for: 'resolve-status' }, 'Status'), status,
      el('label', { for: 'resolve-headers' }, 'Headers (one "name: value" a line)'), headers,
      el('label', { for: 'resolve-body' }, 'Body'), body);
    const sync = () => { completeFields.hidden = !complete.checked; };
    complete.addEventListener('change', sync);
    release.addEventListener('change', sync);
    panel.appendChild(el('div', { class: 'choice' },
      el('label', {}, complete, ' It happened: complete with this response'),
      el('label', {}, release, ' It did not happen: release the key')));
    panel.appendChild(completeFields);
    panel.appendChild(el('label', { for: 'resolve-reason' }, 'Reason (required)'));
    panel.appendChild(reason);
    const out = el('div', { id: 'resolve-out' });
    const review = el('button', { type: 'button', id: 'resolve-review' }, 'Resolve…');
    panel.appendChild(review);
    panel.appendChild(out);

    review.addEventListener('click', () => {
      clear(out);
      const why = reason.value.trim();
      if (!why) {
        out.appendChild(el('p', { class: 'error', role: 'alert' }, 'A reason is required: it is kept in the audit trail.'));
        return;
      }
      let request;
      let consequence;
      if (release.checked) {
        request = { action: 'release', reason: why, generation: r.generation };
        consequence = 'Release: the record is deleted, and the client\'s retry will run the operation again (if the upstream did execute it, it happens twice).';
      } else {
        const code = Number(status.value);
        const parsed = parseHeaders(headers.value);
        if (parsed.error) {
          out.appendChild(el('p', { class: 'error', role: 'alert' }, parsed.error));
          return;
        }
        request = { action: 'complete', status: code, headers: parsed.headers, body_base64: toBase64(body.value), reason: why, generation: r.generation };
        consequence = 'Complete with status ' + code + ': the client\'s retries will get this response replayed, and the operation will not run again.';
      }
      const confirmBox = el('div', { class: 'confirm', id: 'confirm', role: 'alertdialog' },
        el('p', { id: 'consequence' }, consequence),
        el('p', {}, 'Reason: ', el('q', {}, why)));
      const yes = el('button', { type: 'button', id: 'confirm-yes', class: 'danger' }, 'Confirm');
      const no = el('button', { type: 'button', id: 'confirm-no' }, 'Cancel');
      confirmBox.appendChild(yes);
      confirmBox.appendChild(no);
      out.appendChild(confirmBox);
      no.addEventListener('click', () => clear(out));
      yes.addEventListener('click', async () => {
        yes.disabled = true;
        try {
          const done = await api('POST', '/admin/records/' + scopePath(scope) + '/resolve', request);
          const msg = el('p', { class: 'ok', id: 'resolved', role: 'status' }, 'Resolved: ' + text(done.from_state) + ' → ' + text(done.to_state) + '.');
          if (done.to_state === 'released') {
            // The record is gone: nothing left to show but what happened.
            const v = view();
            clear(v);
            v.appendChild(el('h1', {}, 'Record released'));
            v.appendChild(msg);
            v.appendChild(el('p', {}, 'The key is free: the client\'s next retry runs the operation.'));
          } else {
            await record(scope);
            view().insertBefore(msg, view().firstChild);
          }
        } catch (e) {
          if (e.status === 401) return;
          clear(out);
          out.appendChild(problemBox(e));
        }
      });
    });
    return panel;
  }

  function parseHeaders(textValue) {
    const headers = {};
    for (const line of textValue.split('\n')) {
      if (!line.trim()) continue;
      const i = line.indexOf(':');
      if (i <= 0) return { error: 'Header lines are "name: value": ' + line };
      const name = line.slice(0, i).trim().toLowerCase();
      const value = line.slice(i + 1).trim();
      if (headers[name] === undefined) headers[name] = [];
      headers[name].push(value);
    }
    return { headers };
  }

  function toBase64(s) {
    const bytes = new TextEncoder().encode(s);
    let bin = '';
    for (const b of bytes) bin += String.fromCharCode(b);
    return btoa(bin);
  }

  // ---------- events ----------

  async function events() {
    const [pending, parked] = await Promise.all([
      api('GET', '/admin/events?delivery=pending&limit=200'),
      api('GET', '/admin/events?delivery=parked&limit=200'),
    ]);
    const v = view();
    clear(v);
    v.appendChild(el('h1', {}, 'Events'));
    v.appendChild(el('p', {}, 'Pending ' + pending.pending + ', parked ' + pending.parked + '.'));
    const out = el('div', { id: 'events-out' });
    v.appendChild(out);
    const eventRow = (e, redeliver) => row([
      el('code', {}, e.id), e.type, e.scope.operation, el('code', {}, e.scope.key), e.attempts, e.last_error, e.at,
      redeliver ? el('button', { type: 'button', class: 'redeliver', onclick: async () => {
        try {
          await api('POST', '/admin/events/' + seg(e.id) + '/redeliver');
          await events();
          const o = document.getElementById('events-out');
          if (o) o.appendChild(el('p', { class: 'ok', role: 'status' }, 'Event ' + e.id + ' will be delivered again.'));
        } catch (err) {
          if (err.status === 401) return;
          clear(out);
          out.appendChild(problemBox(err));
        }
      } }, 'Redeliver') : '',
    ]);
    const headers = ['Id', 'Type', 'Operation', 'Key', 'Attempts', 'Last error', 'At', ''];
    v.appendChild(el('h2', {}, 'Parked'));
    v.appendChild(table(headers, parked.events.map((e) => eventRow(e, true)), 'events'));
    v.appendChild(el('h2', {}, 'Backlog (pending)'));
    v.appendChild(table(headers, pending.events.map((e) => eventRow(e, false)), 'events'));
  }

  // ---------- audit ----------

  async function audit() {
    const doc = await api('GET', '/admin/audit?limit=200');
    const v = view();
    clear(v);
    v.appendChild(el('h1', {}, 'Audit trail'));
    const t = table(['At', 'Actor', 'Token', 'Operation', 'Key', 'From', 'To', 'Reason'], doc.entries.map((a) =>
      row([a.at, a.actor, a.token, a.scope.operation, el('code', {}, a.scope.key), a.from_state, a.to_state, (a.forced ? '[forced] ' : '') + a.reason])), 'audit');
    t.id = 'audit';
    v.appendChild(t);
  }

  // ---------- start ----------

  document.addEventListener('DOMContentLoaded', () => {
    document.getElementById('login-button').addEventListener('click', logIn);
    document.getElementById('token').addEventListener('keydown', (e) => { if (e.key === 'Enter') logIn(); });
    document.getElementById('logout').addEventListener('click', logOut);
    window.addEventListener('hashchange', route);
    route();
  });
})();

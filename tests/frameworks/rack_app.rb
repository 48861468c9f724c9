# A Rack upstream for tests/it/frameworks.rs, served by WEBrick (which, like
# every CGI-style server, folds `X_Tenant_Id` and `X-Tenant-Id` into one
# HTTP_X_TENANT_ID), behind Rack::MethodOverride (on in every Rails app:
# `_method` in a form body, or X-HTTP-Method-Override, on a POST). Its router
# reads paths as Rails does: an optional format suffix (`(.:format)`),
# parameters without dots, a trailing slash ignored, HEAD as GET, a literal
# route before the parameter route beside it (Rails runs the first that
# matches). Every
# route records what it dispatched; GET /__dispatched lists the records.
# Prints "listening <port>" once it serves.
require 'json'
require 'rack'
require 'webrick'

DISPATCHED = []

FORMAT = '(?:\.[^/.]+)?'
PARAM = '[^/.]+'
ROUTES = [
  ['POST', %r{\A/v1/orders#{FORMAT}\z}, 'create_order'],
  ['PUT', %r{\A/v1/orders/all#{FORMAT}\z}, 'replace_all'],
  ['PUT', %r{\A/v1/orders/#{PARAM}#{FORMAT}\z}, 'replace_order'],
  ['DELETE', %r{\A/v1/orders/#{PARAM}#{FORMAT}\z}, 'delete_order'],
  ['GET', %r{\A/v1/orders/#{PARAM}#{FORMAT}\z}, 'other_order'],
  ['PATCH', %r{\A/v1/orders/#{PARAM}#{FORMAT}\z}, 'other_order'],
  ['POST', %r{\A/v1/orders/all/cancel#{FORMAT}\z}, 'cancel_all'],
  ['POST', %r{\A/v1/orders/#{PARAM}/cancel#{FORMAT}\z}, 'cancel_order'],
  ['GET', %r{\A/v1/reports/#{PARAM}#{FORMAT}\z}, 'read_report'],
  [nil, %r{\A/v1/elsewhere#{FORMAT}\z}, 'elsewhere'],
].freeze

ROUTER = lambda do |env|
  path = env['PATH_INFO']
  if path == '/__dispatched'
    since = Rack::Utils.parse_query(env['QUERY_STRING'].to_s).fetch('since', '0').to_i
    return [200, { 'content-type' => 'application/json' }, [JSON.generate(DISPATCHED.drop(since))]]
  end
  path = path.chomp('/') if path.length > 1
  method = env['REQUEST_METHOD'] == 'HEAD' ? 'GET' : env['REQUEST_METHOD']
  _, _, handler = ROUTES.find { |m, pattern, _| (m.nil? || m == method) && pattern.match?(path) }
  return [404, { 'content-type' => 'application/json' }, ['{"error":"no route"}']] unless handler

  DISPATCHED << {
    handler: handler, method: env['REQUEST_METHOD'], path: env['PATH_INFO'],
    tenant: env['HTTP_X_TENANT_ID'], principal: env['HTTP_X_PRINCIPAL_ID'],
    key: env['HTTP_IDEMPOTENCY_KEY'], generation: env['HTTP_X_IDEMPOTENCY_GENERATION']
  }
  status = %w[GET HEAD].include?(env['REQUEST_METHOD']) ? 200 : 201
  [status, { 'content-type' => 'application/json' }, [JSON.generate(handler: handler)]]
end

app = Rack::Builder.new do
  use Rack::MethodOverride
  run ROUTER
end

server = WEBrick::HTTPServer.new(BindAddress: '127.0.0.1', Port: 0, Logger: WEBrick::Log.new(File::NULL), AccessLog: [])
server.mount '/', Rack::Handler::WEBrick, app
$stdout.puts "listening #{server.listeners[0].addr[1]}"
$stdout.flush
trap('TERM') { server.shutdown }
server.start

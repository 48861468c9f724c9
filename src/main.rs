//! The `idemgate` binary: parses the command line, sets up logging, loads the
//! configuration and maps results to exit codes (0 ok, 1 error, 2 usage).
//! Everything else lives in the library ([`idemgate::telemetry::logging`] and
//! [`idemgate::server::signals`] included). Nothing here prints with `println!` or
//! `eprintln!`, which panic when the stream is a closed pipe.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, anyhow};
use clap::{Args, Parser, Subcommand};
use idemgate::config::{Config, DEFAULT_CONFIG_PATH};
use idemgate::idempotency::key::{IdempotencyKey, Scope, ScopeId};
use idemgate::idempotency::record::State;
use idemgate::outbox::Delivery;
use idemgate::server::Server;
use idemgate::server::reload::{PidFile, signal_reload};
use idemgate::server::signals::Signals;
use idemgate::store::audit::Actor;
use idemgate::store::resolution::{ResolveAction, ResolveError, ResolveRequest};
use idemgate::store::{Access, ListFilter, Store};
use idemgate::telemetry::logging::{self, ErrorChain, LogSettings};

#[derive(Parser)]
#[command(name = "idemgate", version, about = "A reverse proxy that makes retried HTTP writes safe")]
struct Cli {
    /// Configuration file.
    #[arg(long, global = true, env = "IDEMGATE_CONFIG", default_value = DEFAULT_CONFIG_PATH)]
    config: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway. SIGHUP reloads identity sources, routes and upstreams
    /// from the configuration file.
    Serve {
        /// Write the process id here (for `idemgate reload`); removed on exit.
        #[arg(long)]
        pid_file: Option<PathBuf>,
    },
    /// Validate the configuration file, then make the running gateway reload
    /// it (SIGHUP to the pid in --pid-file). An invalid file is not sent.
    Reload {
        /// The file `serve --pid-file` wrote.
        #[arg(long)]
        pid_file: PathBuf,
    },
    /// Validate the configuration; print every error with its TOML path, and
    /// a warning for each insecure setting.
    CheckConfig {
        /// Then reach the store and every upstream (TCP connect), one line each; exit 1 if one fails.
        #[arg(long)]
        connect: bool,
        /// Treat warnings (insecure settings) as errors: exit 1 if there is one.
        #[arg(long)]
        strict: bool,
    },
    /// Apply the store's migrations.
    Migrate,
    /// Inspect and reconcile records.
    #[command(subcommand)]
    Keys(KeysCommand),
    /// The outbox: completion events and their delivery.
    #[command(subcommand)]
    Events(EventsCommand),
    /// Start a demo order service and the gateway in front of it (embedded store).
    Demo(idemgate::demo::DemoArgs),
    /// Ask the running gateway's admin listener whether it is ready: exit 0 if
    /// so, 1 if it is not ready or does not answer, 3 if the configuration
    /// does not say where to ask. Reads only admin.listen: no secret is needed.
    Healthcheck {
        /// Check /healthz (the process answers) instead of /readyz (store reachable, not draining).
        #[arg(long)]
        live: bool,
        /// The admin address to ask, instead of the configuration's admin.listen.
        #[arg(long)]
        addr: Option<std::net::SocketAddr>,
        #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
        timeout: Duration,
    },
}

#[derive(Subcommand)]
enum EventsCommand {
    /// List events, oldest first (all, or only pending or parked ones).
    List {
        #[arg(long, conflicts_with = "parked")]
        pending: bool,
        #[arg(long)]
        parked: bool,
        #[arg(long, default_value_t = 100)]
        limit: u32,
        #[arg(long)]
        json: bool,
    },
    /// Deliver an event again (a parked one, or a sent one), from its first attempt, with the same id.
    Redeliver {
        /// The event id (Idemgate-Event-Id).
        id: uuid::Uuid,
    },
}

#[derive(Subcommand)]
enum KeysCommand {
    /// List records, newest first.
    List {
        #[arg(long, value_parser = parse_state)]
        state: Option<State>,
        #[arg(long)]
        tenant: Option<String>,
        #[arg(long)]
        operation: Option<String>,
        /// Only records kept forever (routes with retention = "forever"): `--retention forever`.
        #[arg(long, value_parser = parse_retention_filter)]
        retention: Option<Forever>,
        #[arg(long, default_value_t = 100)]
        limit: u32,
        /// Continue after the previous page (its `next_cursor`).
        #[arg(long)]
        cursor: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Show one record: state, timestamps, stored response.
    Show {
        #[command(flatten)]
        scope: ShowArgs,
        #[arg(long)]
        json: bool,
    },
    /// Reconcile a record by hand: release it, or record its final response.
    Resolve(ResolveArgs),
    /// The audit trail of resolutions, newest first.
    Audit {
        #[arg(long, default_value_t = 100)]
        limit: u32,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args)]
struct ScopeArgs {
    #[arg(long)]
    tenant: String,
    #[arg(long)]
    principal: String,
    #[arg(long)]
    operation: String,
    #[arg(long)]
    key: String,
}

/// A record by its scope, or by the scope id a log line printed.
#[derive(Args)]
struct ShowArgs {
    /// The id logs print as `scope=...` (16 hex digits), instead of the four parts.
    #[arg(long, conflicts_with_all = ["tenant", "principal", "operation", "key"])]
    scope_id: Option<String>,
    #[arg(long, required_unless_present = "scope_id")]
    tenant: Option<String>,
    #[arg(long, required_unless_present = "scope_id")]
    principal: Option<String>,
    #[arg(long, required_unless_present = "scope_id")]
    operation: Option<String>,
    #[arg(long, required_unless_present = "scope_id")]
    key: Option<String>,
}

#[derive(Args)]
#[command(group(clap::ArgGroup::new("action").required(true).args(["release", "complete"])))]
struct ResolveArgs {
    #[command(flatten)]
    scope: ScopeArgs,
    /// Delete the record so the client may retry the key.
    #[arg(long)]
    release: bool,
    /// Record a final response (with --status) to be replayed.
    #[arg(long, requires = "status")]
    complete: bool,
    #[arg(long)]
    status: Option<u16>,
    /// File with the response body to replay.
    #[arg(long)]
    body_file: Option<PathBuf>,
    /// A response header, 'Name: value' (repeatable).
    #[arg(long = "header")]
    headers: Vec<String>,
    /// How long to replay it; default: the route's retention (or 24h).
    #[arg(long, value_parser = humantime::parse_duration)]
    retention: Option<Duration>,
    /// Why (kept in the audit trail). Required, as it is by the admin API.
    #[arg(long)]
    reason: String,
    /// Also resolve a record that is not unknown or an expired claim (a
    /// completed one). Releasing a completed record lets the client's next
    /// retry execute again: say why with --reason.
    #[arg(long)]
    force: bool,
    /// Resolve only the record at this generation (the one `keys show`
    /// printed): refused if the record moved on since.
    #[arg(long)]
    generation: Option<i64>,
}

/// `keys list --retention forever`.
#[derive(Clone, Copy)]
struct Forever;

fn parse_retention_filter(s: &str) -> Result<Forever, String> {
    match s {
        "forever" => Ok(Forever),
        other => Err(format!("{other:?}: only \"forever\" is supported (records of routes with retention = \"forever\")")),
    }
}

fn parse_state(s: &str) -> Result<State, String> {
    State::parse(s).ok_or_else(|| format!("unknown state {s:?}: use {}", State::names()))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(e) = LogSettings::from_env().and_then(logging::init) {
        logging::stderr_best_effort(&format!("idemgate: {e}\n"));
        return ExitCode::from(1);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            logging::stderr_best_effort(&format!("idemgate: cannot start the runtime: {e}\n"));
            return ExitCode::from(1);
        }
    };
    let result = runtime.block_on(run(cli));
    // The access lines still in the batch.
    logging::flush();
    match result {
        Ok(code) => code,
        Err(e) => {
            logging::stderr_best_effort(&format!("idemgate: {}\n", ErrorChain(e.as_ref())));
            ExitCode::from(1)
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    // The long-running commands take over SIGTERM, SIGINT and SIGHUP before
    // anything slow happens (opening the store, binding): from then on no
    // signal kills them undrained.
    if let Command::Demo(args) = cli.command {
        let signals = Signals::install()?;
        idemgate::demo::run(args, signals.shutdown()).await?;
        return Ok(ExitCode::SUCCESS);
    }
    // Only the admin address: a health check runs where the gateway's
    // secrets are not set, and a configuration problem is not "not ready".
    if let Command::Healthcheck { live, addr, timeout } = cli.command {
        let (addr, cert_file) = match (addr, Config::admin_probe(&cli.config)) {
            (Some(addr), probe) => (addr, probe.ok().and_then(|(_, cert)| cert)),
            (None, Ok((listen, cert))) => (idemgate::ops::healthcheck::local_target(listen), cert),
            (None, Err(e)) => {
                logging::stderr_best_effort(&format!("{e}\n"));
                return Ok(ExitCode::from(HEALTHCHECK_BAD_CONFIG));
            }
        };
        // With [admin.tls], over TLS, trusting exactly the listener's certificate.
        let tls = match cert_file.map(|f| idemgate::tls::client::pinned(&f)) {
            None => None,
            Some(Ok(config)) => Some(config),
            Some(Err(e)) => {
                logging::stderr_best_effort(&format!("{}: admin.tls.cert_file: {e}\n", cli.config.display()));
                return Ok(ExitCode::from(HEALTHCHECK_BAD_CONFIG));
            }
        };
        return Ok(healthcheck(addr, live, timeout, tls).await);
    }
    let config = match Config::load(&cli.config) {
        Ok(c) => c,
        Err(e) => {
            let mut text = format!("{e}\n");
            if matches!(cli.command, Command::CheckConfig { .. }) {
                text.push_str(&format!("{} error(s)\n", e.issues.len()));
            }
            logging::stderr_best_effort(&text);
            return Ok(ExitCode::from(1));
        }
    };
    match cli.command {
        Command::CheckConfig { connect, strict } => {
            // The exit code is the verdict; the lines are best effort.
            let file = cli.config.display();
            let mut warnings: String = config.warnings.iter().map(|w| format!("{file}: {w}\n")).collect();
            if strict && !config.warnings.is_empty() {
                warnings.push_str(&format!("{} warning(s) (--strict)\n", config.warnings.len()));
                logging::stderr_best_effort(&warnings);
                return Ok(ExitCode::from(1));
            }
            logging::stderr_best_effort(&warnings);
            let noted = match config.warnings.len() {
                0 => String::new(),
                n => format!(", {n} warning(s)"),
            };
            say(&format!("{file}: ok ({} route(s), {} upstream(s){noted})\n", config.routes.len(), config.upstreams.len()));
            config.notes().iter().for_each(|n| say(&format!("{file}: note: {n}\n")));
            if connect {
                let checks = idemgate::config::check_connections(&config).await;
                for c in &checks {
                    say(&format!("{c}\n"));
                }
                if !checks.iter().all(|c| c.is_ok()) {
                    return Ok(ExitCode::from(1));
                }
            }
        }
        Command::Serve { pid_file } => {
            config.log_warnings(&cli.config.display().to_string());
            let signals = Signals::install()?;
            // Subscribed before the slow start: a SIGHUP meanwhile reloads once serving.
            let hangups = signals.hangups();
            let tls_hangups = signals.hangups();
            // Its errors name settings (`server.listen`, `server.tls.cert_file`): say in which file.
            let server = Server::bind(config)
                .await
                .with_context(|| cli.config.display().to_string())?
                .reload_from(cli.config.clone(), hangups)
                .with_hangups(tls_hangups);
            let _pid = pid_file.as_deref().map(PidFile::create).transpose()?;
            server.run(signals.shutdown()).await?;
        }
        Command::Reload { pid_file } => {
            let pid = signal_reload(&pid_file)?;
            say(&format!("{}: ok; sent SIGHUP to process {pid} (its log says whether the reload applied)\n", cli.config.display()));
        }
        Command::Migrate => {
            let store = Store::open(&config.store, Access::Migrate).await?;
            let applied = store.migrate().await?;
            if applied.is_empty() {
                say("schema up to date\n");
            } else {
                for m in applied {
                    say(&format!("applied {m}\n"));
                }
            }
        }
        Command::Keys(cmd) => return keys(&config, cmd).await,
        Command::Events(cmd) => return events(&config, cmd).await,
        Command::Demo(_) | Command::Healthcheck { .. } => unreachable!("handled above"),
    }
    Ok(ExitCode::SUCCESS)
}

/// `idemgate healthcheck`'s exit code when its configuration cannot say
/// where the admin listener is (2 is clap's usage error).
const HEALTHCHECK_BAD_CONFIG: u8 = 3;

/// `idemgate healthcheck`: one line, and 0 only for a 200.
async fn healthcheck(
    addr: std::net::SocketAddr,
    live: bool,
    timeout: Duration,
    tls: Option<std::sync::Arc<rustls::ClientConfig>>,
) -> ExitCode {
    let path = if live { "/healthz" } else { "/readyz" };
    match idemgate::ops::healthcheck::probe(addr, path, timeout, tls).await {
        Ok((200, body)) => {
            say(&format!("{path} on {addr}: 200 {body}\n"));
            ExitCode::SUCCESS
        }
        Ok((status, body)) => {
            say(&format!("{path} on {addr}: {status} {body}\n"));
            ExitCode::from(1)
        }
        Err(e) => {
            say(&format!("{path}: {e}\n"));
            ExitCode::from(1)
        }
    }
}

/// Writes what the command exists to print (`keys list`, `keys show`): a
/// closed stdout is an error (exit 1), not a panic.
fn emit(text: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes()).and_then(|()| out.flush()).context("cannot write to stdout")
}

/// Writes a status line to stdout, best effort: the exit code carries the result.
fn say(text: &str) {
    let _ = emit(text);
}

async fn events(config: &Config, cmd: EventsCommand) -> anyhow::Result<ExitCode> {
    let store = Store::open(&config.store, Access::Existing).await.context("opening the store")?;
    match cmd {
        EventsCommand::List { pending, parked, limit, json } => {
            let delivery = if pending {
                Some(Delivery::Pending)
            } else if parked {
                Some(Delivery::Parked)
            } else {
                None
            };
            let events = store.events(delivery, limit).await?;
            if json {
                let list: Vec<_> = events.iter().map(idemgate::outbox::event_json).collect();
                emit(&format!("{}\n", serde_json::to_string_pretty(&list)?))?;
            } else {
                emit(&idemgate::outbox::events_table(&events))?;
            }
        }
        EventsCommand::Redeliver { id } => {
            if store.redeliver(id).await? {
                say(&format!("event {id} will be delivered again\n"));
            } else {
                logging::stderr_best_effort(&format!("no event {id}\n"));
                return Ok(ExitCode::from(1));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn scope(args: &ScopeArgs) -> anyhow::Result<Scope> {
    Ok(Scope {
        tenant: args.tenant.as_str().into(),
        principal: args.principal.as_str().into(),
        operation: args.operation.as_str().into(),
        key: IdempotencyKey::new(&args.key).map_err(|e| anyhow!("--key: {e}"))?,
    })
}

async fn keys(config: &Config, cmd: KeysCommand) -> anyhow::Result<ExitCode> {
    // Operator commands may scan many records (`keys list` on a large table):
    // give them more than the request path's per-statement bound.
    let mut store_config = config.store.clone();
    store_config.operation_timeout = store_config.operation_timeout.max(Duration::from_secs(60));
    // Resolutions write the routes' completion events like the gateway does.
    let store = Store::open(&store_config, Access::Existing)
        .await
        .context("opening the store")?
        .with_events(idemgate::request::route::event_policies(&config.routes));
    let secret = match &config.server.derived_key_secret {
        Some(s) => Some(s.expose().as_bytes().to_vec()),
        None => store.derived_key_secret().await.context("reading the derived-key secret")?,
    };
    let secret = secret.as_deref();
    match cmd {
        KeysCommand::List { state, tenant, operation, retention, limit, cursor, json } => {
            let cursor = cursor.as_deref().map(idemgate::ops::keys::decode_cursor).transpose().context("--cursor")?;
            let filter = ListFilter { state, tenant, operation, forever: retention.is_some(), limit, cursor };
            let page = idemgate::ops::keys::list(&store, &filter).await?;
            if json {
                emit(&format!("{}\n", serde_json::to_string_pretty(&idemgate::ops::keys::page_json(&page, secret))?))?;
            } else {
                emit(&idemgate::ops::keys::list_table(&page.records))?;
                if let Some(next) = &page.next_cursor {
                    emit(&format!("more: --cursor {next}\n"))?;
                }
            }
        }
        KeysCommand::Show { scope: args, json } => {
            let records = match (&args.scope_id, args.tenant, args.principal, args.operation, args.key) {
                (Some(id), ..) => {
                    let id =
                        ScopeId::parse(id).with_context(|| format!("--scope-id {id:?}: expected the 16 hex digits a log line prints"))?;
                    store.find_scope_id(id).await?
                }
                (None, Some(tenant), Some(principal), Some(operation), Some(key)) => {
                    let s = scope(&ScopeArgs { tenant, principal, operation, key })?;
                    store.get(&s).await?.map(|(r, _)| r).into_iter().collect()
                }
                _ => anyhow::bail!("give --scope-id, or --tenant, --principal, --operation and --key"),
            };
            if records.is_empty() {
                logging::stderr_best_effort("no record for that scope\n");
                return Ok(ExitCode::from(1));
            }
            // One record normally; a (64-bit) scope id shared by several
            // records shows each, in the same form.
            let texts: Vec<String> = records
                .iter()
                .map(|r| match json {
                    true => serde_json::to_string_pretty(&idemgate::ops::keys::record_json(r, true, secret)).map(|t| format!("{t}\n")),
                    false => Ok(idemgate::ops::keys::show_text(r, secret)),
                })
                .collect::<Result<_, _>>()?;
            emit(&texts.join(if json { "" } else { "\n" }))?;
        }
        KeysCommand::Resolve(args) => {
            let s = scope(&args.scope)?;
            let action = if args.release {
                ResolveAction::Release
            } else {
                let status = args.status.context("--complete needs --status")?;
                let body = match &args.body_file {
                    Some(f) => std::fs::read(f).with_context(|| format!("reading {}", f.display()))?,
                    None => Vec::new(),
                };
                let mut headers = Vec::new();
                for h in &args.headers {
                    let (name, value) = h.split_once(':').with_context(|| format!("--header {h:?}: expected 'Name: value'"))?;
                    let name = http::HeaderName::from_bytes(name.trim().as_bytes()).with_context(|| format!("--header {h:?}: bad name"))?;
                    let value = http::HeaderValue::from_str(value.trim()).with_context(|| format!("--header {h:?}: bad value"))?;
                    headers.push((name.as_str().to_owned(), value.as_bytes().to_vec()));
                }
                ResolveAction::Complete { status, headers, body: Some(body.into()), retention: args.retention }
            };
            let request = ResolveRequest {
                action,
                reason: Some(args.reason),
                force: args.force,
                actor: Actor::Cli,
                fence: None,
                generation: args.generation.map(idemgate::idempotency::record::Generation),
            };
            let retention = idemgate::ops::keys::default_retention(&config.routes, &s.operation);
            match idemgate::store::resolution::resolve(&store, &s, request, retention).await {
                Ok(from) => say(&format!("resolved (was {from})\n")),
                Err(ResolveError::Store(e)) => return Err(e.into()),
                Err(e @ ResolveError::Refused(idemgate::idempotency::record::TransitionError::NotAllowed(State::Completed))) => {
                    logging::stderr_best_effort(&format!(
                        "{e}: the record is completed and is what retries are replayed; add --force --reason '...' to change it\n"
                    ));
                    return Ok(ExitCode::from(1));
                }
                Err(e) => {
                    logging::stderr_best_effort(&format!("{e}\n"));
                    return Ok(ExitCode::from(1));
                }
            }
        }
        KeysCommand::Audit { limit, json } => {
            let entries = store.audit(limit).await?;
            if json {
                emit(&format!("{}\n", serde_json::to_string_pretty(&idemgate::ops::keys::audit_page_json(&entries))?))?;
            } else {
                emit(&idemgate::ops::keys::audit_table(&entries))?;
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

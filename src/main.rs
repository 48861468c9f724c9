//! The `idemgate` binary: parses the command line, sets up logging, loads the
//! configuration and maps results to exit codes (0 ok, 1 error, 2 usage).
//! Everything else lives in the library.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use clap::{Args, Parser, Subcommand};
use idemgate::config::{Config, DEFAULT_CONFIG_PATH};
use idemgate::record::{State, StoredResponse};
use idemgate::scope::{IdempotencyKey, Scope};
use idemgate::server::Server;
use idemgate::store::{ListFilter, Resolution, ResolveOutcome, Store};
use tokio_util::sync::CancellationToken;

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
    /// Run the gateway.
    Serve,
    /// Validate the configuration; print every error with its TOML path.
    CheckConfig,
    /// Apply the store's migrations.
    Migrate,
    /// Inspect and reconcile records.
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Start a demo order service and the gateway in front of it (embedded store).
    Demo(idemgate::demo::DemoArgs),
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
        #[arg(long, default_value_t = 100)]
        limit: u32,
        #[arg(long)]
        json: bool,
    },
    /// Show one record: state, timestamps, stored response.
    Show {
        #[command(flatten)]
        scope: ScopeArgs,
        #[arg(long)]
        json: bool,
    },
    /// Reconcile a record by hand: release it, or record its final response.
    Resolve(ResolveArgs),
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
}

fn parse_state(s: &str) -> Result<State, String> {
    State::parse(s).ok_or_else(|| format!("unknown state {s:?}: use in_flight, completed or unknown"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("idemgate: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("idemgate: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("IDEMGATE_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if std::env::var("IDEMGATE_LOG_FORMAT").is_ok_and(|f| f == "json") {
        builder.json().flatten_event(true).init();
    } else {
        builder.init();
    }
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    if let Command::Demo(args) = cli.command {
        idemgate::demo::run(args, shutdown_signal()).await?;
        return Ok(ExitCode::SUCCESS);
    }
    let config = match Config::load(&cli.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            if matches!(cli.command, Command::CheckConfig) {
                eprintln!("{} error(s)", e.issues.len());
            }
            return Ok(ExitCode::from(1));
        }
    };
    match cli.command {
        Command::CheckConfig => {
            println!("{}: ok ({} route(s), {} upstream(s))", cli.config.display(), config.routes.len(), config.upstreams.len());
        }
        Command::Serve => {
            let server = Server::bind(config).await?;
            server.run(shutdown_signal()).await?;
        }
        Command::Migrate => {
            let store = Store::open(&config.store, false).await?;
            let applied = store.migrate().await?;
            if applied.is_empty() {
                println!("schema up to date");
            } else {
                for m in applied {
                    println!("applied {m}");
                }
            }
        }
        Command::Keys(cmd) => return keys(&config, cmd).await,
        Command::Demo(_) => unreachable!("handled above"),
    }
    Ok(ExitCode::SUCCESS)
}

/// A token cancelled on SIGTERM or Ctrl-C: the one cancellation root.
fn shutdown_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = term => tracing::info!("SIGTERM received"),
            _ = tokio::signal::ctrl_c() => tracing::info!("interrupt received"),
        }
        t.cancel();
    });
    token
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
    let store = Store::open(&store_config, false).await.context("opening the store")?;
    let secret = config.server.derived_key_secret.as_ref().map(|s| s.expose().as_bytes());
    match cmd {
        KeysCommand::List { state, tenant, operation, limit, json } => {
            let records = store.list(&ListFilter { state, tenant, operation, limit }).await?;
            if json {
                let list: Vec<_> = records.iter().map(|r| idemgate::keys::record_json(r, false, secret)).collect();
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                print!("{}", idemgate::keys::list_table(&records));
            }
        }
        KeysCommand::Show { scope: args, json } => {
            let Some((record, _)) = store.get(&scope(&args)?).await? else {
                eprintln!("no record for that scope");
                return Ok(ExitCode::from(1));
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&idemgate::keys::record_json(&record, true, secret))?);
            } else {
                print!("{}", idemgate::keys::show_text(&record, secret));
            }
        }
        KeysCommand::Resolve(args) => {
            let s = scope(&args.scope)?;
            let resolution = if args.release {
                Resolution::Release
            } else {
                let status = args.status.context("--complete needs --status")?;
                if !(100..=999).contains(&status) {
                    bail!("--status must be an HTTP status (100-999)");
                }
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
                let retention = args.retention.unwrap_or_else(|| {
                    config.routes.iter().find(|r| *r.operation == *s.operation).map_or(Duration::from_secs(24 * 3600), |r| r.retention)
                });
                Resolution::Complete { response: StoredResponse { status, headers, body: Some(body.into()) }, retention }
            };
            match store.resolve(&s, &resolution).await? {
                ResolveOutcome::Resolved => println!("resolved"),
                ResolveOutcome::NotFound => {
                    eprintln!("no record for that scope");
                    return Ok(ExitCode::from(1));
                }
                ResolveOutcome::Refused(why) => {
                    eprintln!("refused: {why}");
                    return Ok(ExitCode::from(1));
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

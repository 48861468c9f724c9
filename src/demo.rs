//! `idemgate demo` (placeholder until the demo lands).
#[derive(Debug, clap::Args)]
pub struct DemoArgs {}
pub async fn run(_args: DemoArgs, _shutdown: tokio_util::sync::CancellationToken) -> anyhow::Result<()> {
    anyhow::bail!("demo not implemented yet")
}

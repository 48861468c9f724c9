//! An in-process TCP fault proxy: put it between a client (the gateway, a
//! `Store`) and a server (PostgreSQL, an upstream) and break the path on
//! command.
//!
//! Every accepted connection is paired with a fresh connection to the target
//! and pumped in both directions. [`FaultProxy::set`] changes what happens to
//! bytes from then on, on existing and new connections alike;
//! [`FaultProxy::blackhole_existing_downstream`] (and `_upstream`) break only
//! the connections open now, so a client that times out and reconnects gets
//! through. That is what an ambiguous commit looks like: the statement reaches
//! the server and commits, the reply never arrives.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// What the proxy does to traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Forward everything unchanged.
    None,
    /// Hold every chunk, in both directions, this long before forwarding it.
    Delay(Duration),
    /// Client-to-server bytes are read and dropped: requests never arrive.
    BlackholeUpstream,
    /// Server-to-client bytes are read and dropped: replies never arrive.
    BlackholeDownstream,
    /// New connections are reset (RST) as soon as they are accepted.
    Refuse,
    /// Each connection is closed after forwarding this many more bytes from
    /// the server to the client (counted from when the fault was set, or
    /// from when the connection opened if later).
    CloseAfter { bytes_down: usize },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    /// Client to server.
    Up,
    /// Server to client.
    Down,
}

/// One proxied connection, as the proxy's control side sees it.
struct Conn {
    /// Cancelling resets both sockets (SO_LINGER 0).
    reset: CancellationToken,
    /// Per-connection blackholes, set only by the `*_existing_*` calls.
    blackhole_up: AtomicBool,
    blackhole_down: AtomicBool,
}

struct Shared {
    target: SocketAddr,
    /// The current fault and a counter bumped by every `set`, so that
    /// `CloseAfter` counts from when it was set.
    fault: Mutex<(Fault, u64)>,
    conns: Mutex<HashMap<u64, Arc<Conn>>>,
    next_id: AtomicU64,
    accepted: AtomicU64,
    /// Cancelled when the proxy is dropped: stops accepting and resets every connection.
    stop: CancellationToken,
}

impl Shared {
    fn fault(&self) -> (Fault, u64) {
        *self.fault.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn conns(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Conn>>> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }
}

pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.stop.cancel();
    }
}

/// Removes a connection from the registry when its task ends, however it ends.
struct Registered {
    id: u64,
    shared: Arc<Shared>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.shared.conns().remove(&self.id);
    }
}

impl FaultProxy {
    /// Listens on `127.0.0.1:0` and forwards every connection to `target`.
    pub async fn start(target: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind fault proxy");
        let addr = listener.local_addr().expect("fault proxy address");
        let shared = Arc::new(Shared {
            target,
            fault: Mutex::new((Fault::None, 0)),
            conns: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            stop: CancellationToken::new(),
        });
        tokio::spawn(accept_loop(listener, shared.clone()));
        FaultProxy { addr, shared }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Applies `fault` to existing and new connections from now on.
    pub fn set(&self, fault: Fault) {
        let mut f = self.shared.fault.lock().unwrap_or_else(|p| p.into_inner());
        *f = (fault, f.1 + 1);
    }

    pub fn fault(&self) -> Fault {
        self.shared.fault().0
    }

    /// Server-to-client bytes of the connections open now are dropped from
    /// now on; connections opened later pass.
    pub fn blackhole_existing_downstream(&self) -> usize {
        let conns = self.shared.conns();
        for c in conns.values() {
            c.blackhole_down.store(true, Ordering::SeqCst);
        }
        conns.len()
    }

    /// Client-to-server bytes of the connections open now are dropped from
    /// now on; connections opened later pass.
    pub fn blackhole_existing_upstream(&self) -> usize {
        let conns = self.shared.conns();
        for c in conns.values() {
            c.blackhole_up.store(true, Ordering::SeqCst);
        }
        conns.len()
    }

    /// Resets (RST, SO_LINGER 0) every open connection, towards both the
    /// client and the server. Returns how many there were.
    pub fn reset_all(&self) -> usize {
        let conns = self.shared.conns();
        for c in conns.values() {
            c.reset.cancel();
        }
        conns.len()
    }

    /// Connections currently open through the proxy.
    pub fn connections(&self) -> usize {
        self.shared.conns().len()
    }

    /// Connections accepted since start (including refused ones).
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Polls until the number of open connections is `n` (teardown is
    /// asynchronous); returns whether it got there within `timeout`.
    pub async fn wait_connections(&self, n: usize, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if self.connections() == n {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let accepted = tokio::select! {
            _ = shared.stop.cancelled() => return,
            a = listener.accept() => a,
        };
        let Ok((client, _)) = accepted else {
            // EMFILE and the like: back off a little rather than spin.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        if shared.fault().0 == Fault::Refuse {
            rst(client);
            continue;
        }
        let id = shared.next_id.fetch_add(1, Ordering::SeqCst);
        let conn = Arc::new(Conn {
            reset: shared.stop.child_token(),
            blackhole_up: AtomicBool::new(false),
            blackhole_down: AtomicBool::new(false),
        });
        // Registered on accept, before the target is even dialled. (A client's
        // connect can return before the accept: after one round trip through
        // the proxy, `connections()` and the `*_existing_*` calls see it.)
        shared.conns().insert(id, conn.clone());
        let guard = Registered { id, shared: shared.clone() };
        tokio::spawn(async move {
            let server = tokio::select! {
                _ = conn.reset.cancelled() => { rst(client); return; }
                s = TcpStream::connect(guard.shared.target) => s,
            };
            match server {
                Ok(server) => proxy_connection(client, server, &conn, &guard.shared).await,
                // The target is down: the client sees a reset, as if refused.
                Err(_) => rst(client),
            }
            drop(guard);
        });
    }
}

/// Drops a socket with SO_LINGER 0, so the peer gets RST rather than FIN.
fn rst(s: TcpStream) {
    let _ = s.set_zero_linger();
    drop(s);
}

async fn proxy_connection(mut client: TcpStream, mut server: TcpStream, conn: &Conn, shared: &Shared) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let reset = {
        let (mut cr, mut cw) = client.split();
        let (mut sr, mut sw) = server.split();
        let up = pump(&mut cr, &mut sw, Dir::Up, conn, shared);
        let down = pump(&mut sr, &mut cw, Dir::Down, conn, shared);
        tokio::select! {
            _ = conn.reset.cancelled() => true,
            // Ends when both directions reached EOF, or at the first error
            // (or a CloseAfter limit) in either.
            _ = async { tokio::try_join!(up, down) } => false,
        }
    };
    if reset {
        rst(client);
        rst(server);
    }
    // Otherwise both are dropped normally: FIN.
}

/// Copies one direction until EOF, applying the current fault to every chunk.
async fn pump<R, W>(from: &mut R, to: &mut W, dir: Dir, conn: &Conn, shared: &Shared) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; 16 * 1024];
    // (fault epoch, bytes forwarded down since) for CloseAfter.
    let mut counted: Option<(u64, usize)> = None;
    loop {
        let n = from.read(&mut buf).await?;
        if n == 0 {
            // Half-close: the other direction keeps going.
            let _ = to.shutdown().await;
            return Ok(());
        }
        let (fault, epoch) = shared.fault();
        let blackholed = match dir {
            Dir::Up => fault == Fault::BlackholeUpstream || conn.blackhole_up.load(Ordering::SeqCst),
            Dir::Down => fault == Fault::BlackholeDownstream || conn.blackhole_down.load(Ordering::SeqCst),
        };
        if blackholed {
            continue;
        }
        match fault {
            Fault::Delay(d) => tokio::time::sleep(d).await,
            Fault::CloseAfter { bytes_down } if dir == Dir::Down => {
                let sent = match counted {
                    Some((e, sent)) if e == epoch => sent,
                    _ => 0,
                };
                let allowed = bytes_down.saturating_sub(sent).min(n);
                to.write_all(&buf[..allowed]).await?;
                counted = Some((epoch, sent + allowed));
                if allowed < n || sent + allowed >= bytes_down {
                    let _ = to.flush().await;
                    return Err(io::Error::other("fault proxy: CloseAfter limit reached"));
                }
                continue;
            }
            _ => {}
        }
        to.write_all(&buf[..n]).await?;
    }
}

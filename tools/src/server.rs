//! Serving an axum [`Router`] over HTTP/1.1: in the foreground for a binary ([`run`], which
//! prints `listening <ip:port>` first) or on a background thread for in-process tests ([`spawn`],
//! whose [`Server`] handle stops it and closes every connection when dropped).
//!
//! Connections set `TCP_NODELAY` (streamed tokens are small writes that must not wait for
//! Nagle) and the listen backlog is large, so thousands of clients can connect at once.

use std::io::{self, Write as _};
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::thread::JoinHandle;

use axum::serve::ListenerExt as _;
use axum::Router;
use socket2::{Domain, Socket, Type};
use tokio::sync::oneshot;

/// Pending connections the kernel may queue (capped by `net.core.somaxconn`).
pub const LISTEN_BACKLOG: i32 = 4096;

/// Binds `host:port` (port 0 picks a free one) with address reuse and a deep backlog.
pub fn bind(host: &str, port: u16) -> io::Result<TcpListener> {
    let addr = (host, port)
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("no address for {host}")))?;
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(LISTEN_BACKLOG)?;
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}

async fn serve(listener: TcpListener, app: Router) -> io::Result<()> {
    let listener = tokio::net::TcpListener::from_std(listener)?.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app).await
}

/// Serves `app` on `listener` until the process ends, printing `listening <ip:port>` as the first
/// stdout line once the socket accepts connections.
pub fn run(listener: TcpListener, app: Router) -> io::Result<()> {
    run_announcing(listener, app, &[])
}

/// [`run`], printing `lines` after the `listening` line (other addresses the process serves).
pub fn run_announcing(listener: TcpListener, app: Router, lines: &[String]) -> io::Result<()> {
    let addr = listener.local_addr()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut out = io::stdout().lock();
    writeln!(out, "listening {addr}")?;
    for line in lines {
        writeln!(out, "{line}")?;
    }
    out.flush()?;
    drop(out);
    rt.block_on(serve(listener, app))
}

/// A server running on a background thread (see [`spawn`]). Dropping it shuts it down.
pub struct Server {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

/// Serves `app` on `listener` from a background thread with its own runtime.
pub fn spawn(listener: TcpListener, app: Router) -> io::Result<Server> {
    let addr = listener.local_addr()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(format!("http-server-{}", addr.port()))
        .enable_all()
        .build()?;
    let (stop, stopped) = oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name(format!("http-server-{addr}"))
        .spawn(move || {
            rt.block_on(async {
                tokio::select! {
                    r = serve(listener, app) => {
                        if let Err(e) = r {
                            eprintln!("http server {addr}: {e}");
                        }
                    }
                    _ = stopped => {}
                }
            });
            // Dropping the runtime cancels every connection task: their sockets close.
            drop(rt);
        })?;
    Ok(Server {
        addr,
        stop: Some(stop),
        thread: Some(thread),
    })
}

impl Server {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address as `ip:port` (a wildcard bind is reported as 127.0.0.1).
    pub fn addr_string(&self) -> String {
        let mut a = self.addr;
        if a.ip().is_unspecified() {
            a.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        a.to_string()
    }

    /// Stops accepting and closes every open connection (in-flight responses fail).
    pub fn shutdown(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop_now();
    }
}

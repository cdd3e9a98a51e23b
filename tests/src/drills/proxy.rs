//! A loopback TCP proxy between a router and a relay, to fault the network between them: cut
//! (every connection dropped, new ones closed at once: a partition), paused (nothing forwarded
//! from the relay: a stalled router or link), or throttled (relay-to-router bytes per second).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// How the relay-to-router direction is slowed.
#[derive(Default)]
struct Slow {
    paused: AtomicBool,
    /// Bytes per second; 0: unlimited.
    rate: AtomicU64,
}

/// A running proxy on `127.0.0.1` (its task lives on the runtime it was started on).
pub struct Proxy {
    pub addr: SocketAddr,
    cut: watch::Sender<bool>,
    slow: Arc<Slow>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Forwards connections on a new loopback port to `target`.
    pub fn start(rt: &tokio::runtime::Handle, target: SocketAddr) -> Proxy {
        let listener = rt.block_on(TcpListener::bind("127.0.0.1:0")).expect("bind the proxy");
        let _in_rt = rt.enter();
        Proxy::serve(listener, target)
    }

    /// Forwards connections on `listener` to `target` (on the current runtime).
    pub fn serve(listener: TcpListener, target: SocketAddr) -> Proxy {
        let addr = listener.local_addr().expect("proxy address");
        let (cut, cut_rx) = watch::channel(false);
        let slow = Arc::new(Slow::default());
        let s = slow.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((down, _)) = listener.accept().await else { continue };
                if *cut_rx.borrow() {
                    continue; // dropped: closed at once
                }
                let Ok(up) = TcpStream::connect(target).await else { continue };
                let _ = (down.set_nodelay(true), up.set_nodelay(true));
                let ((dr, dw), (ur, uw)) = (down.into_split(), up.into_split());
                tokio::spawn(pump(dr, uw, cut_rx.clone(), None));
                tokio::spawn(pump(ur, dw, cut_rx.clone(), Some(s.clone())));
            }
        });
        Proxy { addr, cut, slow, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Cuts (drops every connection and refuses new ones) or restores the link.
    pub fn set_cut(&self, on: bool) {
        self.cut.send_replace(on);
    }

    /// Stops (or restarts) forwarding anything from the relay; connections stay open.
    pub fn set_paused(&self, on: bool) {
        self.slow.paused.store(on, Ordering::SeqCst);
    }

    /// Limits the relay-to-router direction to `bytes_per_second` (0: unlimited).
    pub fn set_rate(&self, bytes_per_second: u64) {
        self.slow.rate.store(bytes_per_second, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
        self.cut.send_replace(true);
    }
}

/// Copies `from` to `to` until either end closes or the link is cut.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut cut: watch::Receiver<bool>,
    slow: Option<Arc<Slow>>,
) {
    let mut buf = vec![0u8; 16 << 10];
    loop {
        while slow.as_ref().is_some_and(|s| s.paused.load(Ordering::SeqCst)) {
            if *cut.borrow() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let n = tokio::select! {
            _ = cut.wait_for(|c| *c) => return,
            r = from.read(&mut buf) => match r {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
        };
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
        let rate = slow.as_ref().map_or(0, |s| s.rate.load(Ordering::SeqCst));
        if rate > 0 {
            tokio::time::sleep(Duration::from_secs_f64(n as f64 / rate as f64)).await;
        }
    }
}

//! ZeroMQ sockets watched for the drop of their connection to the engine, and the rank's SUB.

use super::rank::RankConfig;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// How long a socket whose connection dropped is read for the messages libzmq read before the
/// drop (they are handed on within microseconds of it; the margin is for a loaded host).
const DROP_SETTLE: Duration = Duration::from_millis(100);

/// The value for `ZMQ_MAXMSGSIZE` (an `i64`; larger bounds mean no bound).
fn max_msg(bytes: u64) -> i64 {
    i64::try_from(bytes).unwrap_or(-1)
}

/// A socket and a monitor that says when its connection to the engine drops.
///
/// libzmq drops a connection whose peer sends a message over `ZMQ_MAXMSGSIZE` as a protocol
/// error, and does not connect it again: the socket is replaced (by the replay client, and by
/// the rank when its SUB's connection drops).
pub(super) struct Watched {
    pub socket: zmq::Socket,
    pub monitor: zmq::Socket,
}

impl Watched {
    /// A socket of `kind`, set up by `setup`, bounded to `max_message_bytes`, connected to
    /// `endpoint` and watched.
    pub fn open(
        ctx: &zmq::Context,
        kind: zmq::SocketType,
        endpoint: &str,
        max_message_bytes: u64,
        setup: impl FnOnce(&zmq::Socket) -> Result<(), zmq::Error>,
    ) -> Result<Watched, zmq::Error> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let socket = ctx.socket(kind)?;
        socket.set_linger(0)?;
        socket.set_maxmsgsize(max_msg(max_message_bytes))?;
        setup(&socket)?;
        let name = format!("inproc://kv-relay-monitor-{}", NEXT.fetch_add(1, Ordering::Relaxed));
        socket.monitor(&name, zmq::SocketEvent::DISCONNECTED as i32)?;
        let monitor = ctx.socket(zmq::PAIR)?;
        monitor.set_linger(0)?;
        monitor.connect(&name)?;
        socket.connect(endpoint)?;
        Ok(Watched { socket, monitor })
    }

    /// Forgets drops reported before now (the engine restarted between two replays).
    pub fn forget_drops(&self) {
        while self.monitor.recv_multipart(zmq::DONTWAIT).is_ok() {}
    }

    /// After a drop: what the socket still hands on, each message until none comes for
    /// [`DROP_SETTLE`]. libzmq reports the drop before it hands on the messages it read
    /// before the one it refused. `take` returns true to stop early, and then so does this.
    pub fn settle(&self, mut take: impl FnMut(Vec<Vec<u8>>) -> bool) -> Result<bool, zmq::Error> {
        loop {
            let mut items = [self.socket.as_poll_item(zmq::POLLIN)];
            zmq::poll(&mut items, DROP_SETTLE.as_millis() as i64)?;
            if !items[0].is_readable() {
                return Ok(false);
            }
            if take(self.socket.recv_multipart(0)?) {
                return Ok(true);
            }
        }
    }
}

/// The rank's SUB socket on the engine's PUB endpoint.
pub(super) fn open_sub(ctx: &zmq::Context, cfg: &RankConfig) -> Result<Watched, zmq::Error> {
    Watched::open(ctx, zmq::SUB, &cfg.pub_endpoint, cfg.max_message_bytes, |sub| {
        sub.set_rcvhwm(cfg.rcvhwm)?;
        sub.set_reconnect_ivl(100)?;
        sub.set_reconnect_ivl_max(2000)?;
        sub.set_subscribe(cfg.topic.as_bytes())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bound_past_i64_is_no_bound_and_the_sockets_take_every_bound() {
        assert_eq!(max_msg(16 << 20), 16 << 20);
        assert_eq!(max_msg(i64::MAX as u64), i64::MAX);
        assert_eq!(max_msg(i64::MAX as u64 + 1), -1);
        assert_eq!(max_msg(u64::MAX), -1);
        // libzmq takes each of them (a negative other than -1 would be refused).
        let ctx = zmq::Context::new();
        for bytes in [64 << 10, 16 << 20, u64::MAX] {
            let w = Watched::open(&ctx, zmq::DEALER, "tcp://127.0.0.1:1", bytes, |_| Ok(())).unwrap();
            assert_eq!(w.socket.get_maxmsgsize().unwrap(), max_msg(bytes));
        }
    }
}

//! systemd's notify protocol (`Type=notify`, `WatchdogSec=`), without a crate: one datagram to
//! the socket named by `$NOTIFY_SOCKET` per state change (`sd_notify(3)`).
//!
//! Outside systemd (`$NOTIFY_SOCKET` unset) every call does nothing. A failed send is logged and
//! otherwise ignored: the relay keeps relaying, and systemd acts on what it did not hear (a
//! start timeout, a watchdog restart).

use std::ffi::OsStr;
use std::io;
use std::os::unix::net::UnixDatagram;
use std::time::Duration;

/// `READY=1`: the store is open and the listener bound.
pub fn ready() {
    notify("READY=1");
}

/// `WATCHDOG=1`: the daemon is alive; call it every [`watchdog_interval`].
pub fn watchdog() {
    notify("WATCHDOG=1");
}

/// `STOPPING=1`: a graceful shutdown has begun.
pub fn stopping() {
    notify("STOPPING=1");
}

/// `STATUS=…`: one line shown by `systemctl status`.
pub fn status(line: &str) {
    notify(&format!("STATUS={}", line.replace('\n', " ")));
}

/// How often to call [`watchdog`]: half of the unit's `WatchdogSec` (`$WATCHDOG_USEC`), so one
/// late ping is not a restart. `None` when no watchdog is armed for this process (unset, zero,
/// or `$WATCHDOG_PID` names another process).
pub fn watchdog_interval() -> Option<Duration> {
    interval_from(
        std::env::var("WATCHDOG_USEC").ok().as_deref(),
        std::env::var("WATCHDOG_PID").ok().as_deref(),
        std::process::id(),
    )
}

fn interval_from(usec: Option<&str>, pid: Option<&str>, me: u32) -> Option<Duration> {
    if let Some(pid) = pid {
        if pid.trim().parse::<u32>().ok()? != me {
            return None;
        }
    }
    let usec: u64 = usec?.trim().parse().ok()?;
    (usec > 0).then(|| Duration::from_micros(usec / 2))
}

fn notify(state: &str) {
    let Some(socket) = std::env::var_os("NOTIFY_SOCKET") else { return };
    if let Err(e) = send(&socket, state) {
        tracing::warn!(error = %e, socket = ?socket, state, "systemd notification not sent");
    }
}

/// Sends `state` to the notify socket at `socket`: a path, or an abstract name when it starts
/// with `@`.
pub fn send(socket: &OsStr, state: &str) -> io::Result<()> {
    let sock = UnixDatagram::unbound()?;
    let bytes = socket.as_encoded_bytes();
    let sent = match bytes.first() {
        Some(b'@') => send_abstract(&sock, &bytes[1..], state)?,
        Some(b'/') => sock.send_to(state.as_bytes(), socket)?,
        _ => return Err(io::Error::new(io::ErrorKind::InvalidInput, "NOTIFY_SOCKET is neither a path nor @abstract")),
    };
    if sent != state.len() {
        return Err(io::Error::new(io::ErrorKind::WriteZero, "short write to the notify socket"));
    }
    Ok(())
}

#[cfg(any(target_os = "linux", target_os = "android"))]
fn send_abstract(sock: &UnixDatagram, name: &[u8], state: &str) -> io::Result<usize> {
    #[cfg(target_os = "android")]
    use std::os::android::net::SocketAddrExt;
    #[cfg(target_os = "linux")]
    use std::os::linux::net::SocketAddrExt;
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
    sock.send_to_addr(state.as_bytes(), &addr)
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn send_abstract(_: &UnixDatagram, _: &[u8], _: &str) -> io::Result<usize> {
    Err(io::Error::new(io::ErrorKind::Unsupported, "abstract sockets are Linux only"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recv(sock: &UnixDatagram) -> String {
        let mut buf = [0u8; 256];
        sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let n = sock.recv(&mut buf).unwrap();
        String::from_utf8(buf[..n].to_vec()).unwrap()
    }

    #[test]
    fn states_arrive_at_a_path_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let listener = UnixDatagram::bind(&path).unwrap();
        for state in ["READY=1", "WATCHDOG=1", "STOPPING=1", "STATUS=serving 2 ranks"] {
            send(path.as_os_str(), state).unwrap();
            assert_eq!(recv(&listener), state);
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn states_arrive_at_an_abstract_socket() {
        use std::os::linux::net::SocketAddrExt;
        let name = format!("kv-relay-notify-test-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let listener = UnixDatagram::bind_addr(&addr).unwrap();
        send(OsStr::new(&format!("@{name}")), "READY=1").unwrap();
        assert_eq!(recv(&listener), "READY=1");
    }

    #[test]
    fn a_missing_or_malformed_socket_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        assert!(send(dir.path().join("absent").as_os_str(), "READY=1").is_err());
        assert_eq!(send(OsStr::new("relative"), "READY=1").unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert_eq!(send(OsStr::new(""), "READY=1").unwrap_err().kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn watchdog_interval_is_half_of_watchdog_usec_for_this_process_only() {
        assert_eq!(interval_from(Some("30000000"), None, 7), Some(Duration::from_secs(15)));
        assert_eq!(interval_from(Some("30000000"), Some("7"), 7), Some(Duration::from_secs(15)));
        assert_eq!(interval_from(Some("30000000"), Some("8"), 7), None);
        assert_eq!(interval_from(Some("0"), None, 7), None);
        assert_eq!(interval_from(Some("soon"), None, 7), None);
        assert_eq!(interval_from(None, None, 7), None);
    }

    #[test]
    fn the_public_calls_send_to_notify_socket_when_set() {
        // The only test in this crate that touches NOTIFY_SOCKET.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let listener = UnixDatagram::bind(&path).unwrap();
        std::env::set_var("NOTIFY_SOCKET", &path);
        ready();
        watchdog();
        status("primed\nserving");
        stopping();
        std::env::remove_var("NOTIFY_SOCKET");
        ready(); // unset: nothing sent, nothing fails
        assert_eq!(
            [recv(&listener), recv(&listener), recv(&listener), recv(&listener)],
            ["READY=1", "WATCHDOG=1", "STATUS=primed serving", "STOPPING=1"]
        );
        listener.set_nonblocking(true).unwrap();
        assert!(listener.recv(&mut [0u8; 16]).is_err());
    }
}

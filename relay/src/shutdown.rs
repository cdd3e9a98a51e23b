//! The relay's one stop signal: triggered once, seen by async tasks ([`Shutdown::recv`]) and by
//! blocking threads ([`Shutdown::is_shutdown`]). The daemon's tasks, the rank threads, the
//! commits and the server's streams each hold a [`Shutdown`] of the trigger that stops them.
//! (The store's checkpoint and sync threads stop when the store closes: that is the store's own
//! lifetime, not a stop signal.)

use tokio::sync::watch;

/// Sets the signal (once; later calls do nothing). Dropping it sets it too: a stop signal whose
/// sender is gone can never be told to go on.
#[derive(Debug)]
pub struct ShutdownTrigger(watch::Sender<bool>);

/// One holder's view of the signal. Clone it for another holder.
#[derive(Debug, Clone)]
pub struct Shutdown(watch::Receiver<bool>);

impl Default for ShutdownTrigger {
    fn default() -> Self {
        ShutdownTrigger(watch::channel(false).0)
    }
}

impl ShutdownTrigger {
    pub fn new() -> ShutdownTrigger {
        ShutdownTrigger::default()
    }

    /// A holder of this signal.
    pub fn subscribe(&self) -> Shutdown {
        Shutdown(self.0.subscribe())
    }

    /// Stops every holder.
    pub fn trigger(&self) {
        self.0.send_replace(true);
    }
}

impl Drop for ShutdownTrigger {
    fn drop(&mut self) {
        self.trigger();
    }
}

impl Shutdown {
    /// Whether the signal is set (a trigger sets it when dropped, too). Cheap: a blocking thread
    /// asks it each turn of its loop.
    pub fn is_shutdown(&self) -> bool {
        *self.0.borrow()
    }

    /// Waits until the signal is set (at once if it is, or if its trigger is gone).
    pub async fn recv(&mut self) {
        let _ = self.0.wait_for(|stop| *stop).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn every_holder_sees_the_signal_once_it_is_set_or_its_trigger_is_gone() {
        let trigger = ShutdownTrigger::new();
        let (mut a, b) = (trigger.subscribe(), trigger.subscribe());
        assert!(!a.is_shutdown() && !b.is_shutdown());
        assert!(tokio::time::timeout(Duration::from_millis(20), a.recv()).await.is_err(), "not set yet");
        let waiting = tokio::spawn({
            let mut c = b.clone();
            async move { c.recv().await }
        });
        trigger.trigger();
        waiting.await.unwrap();
        a.recv().await;
        assert!(a.is_shutdown() && b.is_shutdown());
        trigger.trigger();
        assert!(b.is_shutdown());

        let dropped = ShutdownTrigger::new();
        let mut d = dropped.subscribe();
        drop(dropped);
        assert!(d.is_shutdown());
        d.recv().await;
    }
}

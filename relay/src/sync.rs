//! Locks taken whatever a panic left behind: the one rule of this crate.
//!
//! Each value behind a lock here (a rank's status, the store's writer and live set, the loads,
//! the checkpoints' state) is changed by its writers in steps that each leave it whole, and a
//! panic is reported where it happened. So a lock a panic poisoned is taken as it is, and the
//! daemon's other threads (ingest, commits, streams, status) go on instead of panicking in turn.

use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// [`Mutex::lock`], poisoned or not.
pub(crate) trait Locked<T: ?Sized> {
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T: ?Sized> Locked<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// [`RwLock::read`] and [`RwLock::write`], poisoned or not.
pub(crate) trait ReadWrite<T: ?Sized> {
    fn reading(&self) -> RwLockReadGuard<'_, T>;
    fn writing(&self) -> RwLockWriteGuard<'_, T>;
}

impl<T: ?Sized> ReadWrite<T> for RwLock<T> {
    fn reading(&self) -> RwLockReadGuard<'_, T> {
        self.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn writing(&self) -> RwLockWriteGuard<'_, T> {
        self.write().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_lock_a_panic_poisoned_is_taken_with_what_it_holds() {
        let m = Arc::new(Mutex::new(1));
        let rw = Arc::new(RwLock::new(2));
        let (m2, rw2) = (m.clone(), rw.clone());
        let _ = std::thread::spawn(move || {
            let mut a = m2.lock().unwrap();
            let mut b = rw2.write().unwrap();
            *a = 10;
            *b = 20;
            panic!("poisons both");
        })
        .join();
        assert!(m.is_poisoned() && rw.is_poisoned());
        assert_eq!(*m.locked(), 10);
        assert_eq!(*rw.reading(), 20);
        *rw.writing() = 30;
        assert_eq!(*rw.reading(), 30);
    }
}

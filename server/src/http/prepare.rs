//! Request preparation off the async runtime. Rendering the chat template, tokenizing,
//! turning JSON Schemas into grammars and compiling them take from microseconds to (for the
//! largest allowed requests) a good fraction of a second of CPU, and llama.cpp's schema
//! conversion recurses deeply. On an HTTP worker thread that stalls every other connection
//! it serves (`/health` included), and a 2 MiB async stack can overflow and abort the
//! process. So that work runs here: on a few dedicated threads with large stacks, at the HTTP
//! threads' low priority, behind a bounded queue whose overflow is a clear 429.

use std::sync::{Arc, LazyLock};

use tokio::sync::Semaphore;

use super::error::ApiError;

/// Preparation threads at most: enough to keep a few requests moving on a bigger machine,
/// few enough that preparation never competes with the engine for every core.
const MAX_THREADS: usize = 4;

/// Requests that may wait for a preparation thread; beyond that new requests get 429. Each
/// waiting request holds its body (up to `--body-limit`) in memory, so this bounds that too.
const QUEUE: usize = 64;

/// Stack of a preparation thread. The request caps keep llama.cpp's recursion (once per
/// optional property, per regex group, per schema level) far below this; the margin is
/// cheap, since untouched stack pages are never backed by memory.
const STACK_BYTES: usize = 64 << 20;

struct Pool {
    /// Holds only the blocking pool: its threads are the preparation threads.
    runtime: tokio::runtime::Runtime,
    /// One permit per running or waiting preparation.
    admitted: Arc<Semaphore>,
}

static POOL: LazyLock<Pool> = LazyLock::new(|| {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(MAX_THREADS);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .max_blocking_threads(threads)
        .thread_stack_size(STACK_BYTES)
        .thread_name("hearth-prepare")
        .on_thread_start(|| crate::process::lower_thread_priority(crate::process::HTTP_NICE))
        .build()
        .expect("the preparation pool's runtime starts (it opens no I/O driver)");
    Pool { runtime, admitted: Arc::new(Semaphore::new(threads + QUEUE)) }
});

/// Runs `work` on a preparation thread and waits for it without blocking the caller's
/// runtime. A full queue is [`ApiError::PreparationBusy`]; a panic in `work` is a 500, not a
/// dead server. If the client goes away meanwhile, `work` still finishes (it cannot be
/// interrupted) and its result is dropped; its queue place is freed when it ends.
pub async fn run<T, F>(work: F) -> Result<T, ApiError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, ApiError> + Send + 'static,
{
    let pool = &*POOL;
    let permit = pool.admitted.clone().try_acquire_owned().map_err(|_| ApiError::PreparationBusy)?;
    let task = pool.runtime.spawn_blocking(move || {
        let _permit = permit;
        work()
    });
    task.await.map_err(|e| ApiError::Internal(format!("request preparation failed: {e}")))?
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::RwLock;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_queue_is_a_429_and_a_panic_a_500() {
        let capacity = POOL.admitted.available_permits();
        // Every admitted preparation waits on the gate until the test opens it.
        let gate = Arc::new(RwLock::new(()));
        let closed = gate.write().unwrap();
        let waiting: Vec<_> = (0..capacity)
            .map(|_| {
                let gate = gate.clone();
                tokio::spawn(run(move || {
                    drop(gate.read().unwrap());
                    Ok(())
                }))
            })
            .collect();
        while POOL.admitted.available_permits() > 0 {
            tokio::task::yield_now().await;
        }
        let refused = run(|| Ok(())).await.unwrap_err();
        assert!(matches!(refused, ApiError::PreparationBusy));
        assert_eq!(refused.status(), axum::http::StatusCode::TOO_MANY_REQUESTS);
        drop(closed);
        for w in waiting {
            w.await.unwrap().unwrap();
        }
        let failed = run(|| -> Result<(), ApiError> { panic!("a bug in preparation") }).await.unwrap_err();
        assert_eq!(failed.status(), axum::http::StatusCode::INTERNAL_SERVER_ERROR);
        // The pool is whole again.
        assert_eq!(run(|| Ok(7)).await.unwrap(), 7);
        assert_eq!(POOL.admitted.available_permits(), capacity);
    }
}

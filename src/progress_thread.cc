// The progress thread: sends that could not execute when they were posted
// (an RNR wait, a target's receive record busy, a target not yet ready, a
// WQE queued behind one of those) execute when the initiator calls
// ibv_poll_cq, ibv_post_send or a blocking ibv_get_cq_event. A NIC executes
// what was posted without being called again, and programs rely on it:
// rsockets' riostream posts an RDMA WRITE and then spins on its own memory
// for the peer's answer, making no verbs call, while the peer spins on the
// byte that WRITE carries. So while sends wait, this thread retries them
// every SHMRDMA_RETRY_POLL_MS (2 ms; the transport's timer) for as long as
// nothing else does: when some other call drove the queues during the
// period (progress_calls_ changed), it leaves them to the application, so a
// program that polls keeps its send queue locks to itself (BiasedLock: a
// second thread taking a QP's lock revokes its owner's bias for good).
//
// Started the first time sends wait (kick_progress, from mark_pending), so a
// context whose sends never wait has no thread. With no QP's sends waiting
// it sleeps on pt_cv_: it sets pt_sleeping_ and then looks at qps_pending_
// again, and mark_pending raises qps_pending_ from 0 and then reads
// pt_sleeping_ (both seq_cst), so either the thread sees the waiting sends
// or mark_pending sees it asleep and wakes it (under pt_mu_, which the
// thread holds from its look until it waits). An awake thread costs
// mark_pending one load. A fork child does not have its parent's thread and
// starts none (pt_pid_ names the parent): its own calls drive its queues.
// ~LocalContext stops and joins it first, so it never runs progress_pending
// on a context being torn down.
#include <signal.h>
#include <unistd.h>

#include <chrono>

#include "context.h"

namespace shmrdma {

void LocalContext::kick_progress() noexcept {
  const pid_t started = pt_pid_.load(std::memory_order_acquire);
  if (started != 0) {
    if (!pt_sleeping_.load(std::memory_order_seq_cst)) return;  // awake: it finds qps_pending_ at its next look
    if (started != ::getpid()) return;                          // a fork child: the thread is the parent's
    std::lock_guard lk(pt_mu_);
    pt_cv_.notify_one();
    return;
  }
  const pid_t self = ::getpid();
  std::lock_guard lk(pt_mu_);
  if (pt_stop_ || pt_pid_.load(std::memory_order_relaxed) != 0) return;
  // The thread starts with every signal blocked, so the application's
  // handlers never run on it; it starts awake.
  sigset_t all, old;
  sigfillset(&all);
  if (::pthread_sigmask(SIG_SETMASK, &all, &old) != 0) return;
  const int rc = ::pthread_create(&pt_thread_, nullptr, &LocalContext::progress_main, this);
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
  if (rc == 0) pt_pid_.store(self, std::memory_order_release);
  // else no thread: the application's calls drive the queues, as without one
}

void LocalContext::stop_progress() noexcept {
  const pid_t started = pt_pid_.load(std::memory_order_acquire);
  if (started == 0 || started != ::getpid()) return;  // none here
  {
    std::lock_guard lk(pt_mu_);
    pt_stop_ = true;
    pt_cv_.notify_one();
  }
  ::pthread_join(pt_thread_, nullptr);
}

void LocalContext::progress_pending() noexcept {
  std::lock_guard lk(mu_);
  const RnrLookNow look(this);  // context.h
  for (Qp* q : live_qps_)
    if (q->sq_pending.load(std::memory_order_relaxed)) progress(q);
}

void* LocalContext::progress_main(void* self) noexcept {
  auto* c = static_cast<LocalContext*>(self);
  const auto period = std::chrono::milliseconds(retry_poll_ms());
  std::unique_lock lk(c->pt_mu_);
  while (!c->pt_stop_) {
    if (c->qps_pending_.load(std::memory_order_seq_cst) == 0) {
      c->pt_sleeping_.store(true, std::memory_order_seq_cst);
      if (c->qps_pending_.load(std::memory_order_seq_cst) == 0) c->pt_cv_.wait(lk);  // until sends wait again
      c->pt_sleeping_.store(false, std::memory_order_relaxed);
      continue;
    }
    const uint32_t calls = c->progress_calls_.load(std::memory_order_relaxed);
    c->pt_cv_.wait_for(lk, period, [c] { return c->pt_stop_; });
    if (c->pt_stop_) break;
    if (c->qps_pending_.load(std::memory_order_relaxed) == 0 ||
        c->progress_calls_.load(std::memory_order_relaxed) != calls)
      continue;  // nothing waits, or the application drove its queues itself
    lk.unlock();
    c->progress_pending();
    lk.lock();
  }
  return nullptr;
}

}  // namespace shmrdma

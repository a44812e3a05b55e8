/* A SIGBUS handler for reads past the end of a model file cut short while it is mapped.
 *
 * Python registers the address ranges of its model files' mappings (mm3_guard_add). A read of a
 * mapped page that the file no longer holds faults with SIGBUS; where the faulting address lies in
 * a registered range, the handler maps a zero-filled anonymous page over the faulting page, counts
 * the fault for that range and returns, so the read goes on with zeros and the engine, seeing the
 * count (mm3_guard_faults) when the unit of work ends, stops the run with an error naming the file.
 * Any other SIGBUS goes to the handler that was there before (a function is called; the default or
 * an ignore is put back and the signal raised again), so a real crash still crashes.
 *
 * The handler reads the table without locks (atomics only) and calls only mmap and sigaction:
 * async-signal-safe. The table is written by one thread at a time (the caller holds a lock).
 */
#if defined(__APPLE__)
#define _DARWIN_C_SOURCE
#else
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MAP_ANONYMOUS
#define MAP_ANONYMOUS MAP_ANON
#endif

#define SLOTS 1024

typedef struct {
    _Atomic uintptr_t start; /* 0: a free slot */
    _Atomic uintptr_t end;
    _Atomic long faults;
} range_t;

static range_t ranges[SLOTS];
static struct sigaction previous;
static uintptr_t page_size;
static int installed;

/* Whether the kernel sent the signal for a fault (not kill, raise or a queue). */
static int from_fault(const siginfo_t *info) {
#if defined(__linux__)
    return info->si_code > 0;
#else
    if (info->si_code == SI_USER) return 0;
#ifdef SI_QUEUE
    if (info->si_code == SI_QUEUE) return 0;
#endif
    return 1;
#endif
}

static void hand_on(int sig, siginfo_t *info, void *context) {
    void *h = (previous.sa_flags & SA_SIGINFO) ? (void *)previous.sa_sigaction : (void *)previous.sa_handler;
    if (h != (void *)SIG_DFL && h != (void *)SIG_IGN) {
        if (previous.sa_flags & SA_SIGINFO)
            previous.sa_sigaction(sig, info, context);
        else
            previous.sa_handler(sig);
        return;
    }
    /* The default action: put it back and raise the signal again; it is blocked in this handler, so
       it ends the process as this handler returns (a fault would also fault again). */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL);
    raise(sig);
}

static void on_bus(int sig, siginfo_t *info, void *context) {
    if (info != NULL && from_fault(info)) {
        uintptr_t at = (uintptr_t)info->si_addr;
        for (int i = 0; i < SLOTS; i++) {
            uintptr_t start = atomic_load_explicit(&ranges[i].start, memory_order_acquire);
            if (start == 0 || at < start) continue;
            uintptr_t end = atomic_load_explicit(&ranges[i].end, memory_order_acquire);
            if (at >= end || atomic_load_explicit(&ranges[i].start, memory_order_acquire) != start) continue;
            int saved = errno;
            void *page = (void *)(at & ~(page_size - 1));
            void *got = mmap(page, page_size, PROT_READ | PROT_WRITE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            errno = saved;
            if (got != page) break;
            atomic_fetch_add_explicit(&ranges[i].faults, 1, memory_order_release);
            return;
        }
    }
    hand_on(sig, info, context);
}

/* Install the handler (once a process); 1 where it is in place, 0 where it could not be. */
int mm3_guard_install(void) {
    if (installed) return 1;
    long size = sysconf(_SC_PAGESIZE);
    if (size <= 0) return 0;
    page_size = (uintptr_t)size;
    struct sigaction act;
    memset(&act, 0, sizeof act);
    act.sa_sigaction = on_bus;
    act.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&act.sa_mask);
    if (sigaction(SIGBUS, &act, &previous) != 0) return 0;
    installed = 1;
    return 1;
}

/* Register the mapping [start, start + length): its slot, or -1 where the table is full. */
int mm3_guard_add(uintptr_t start, uintptr_t length) {
    if (start == 0 || length == 0) return -1;
    for (int i = 0; i < SLOTS; i++) {
        if (atomic_load_explicit(&ranges[i].start, memory_order_acquire) != 0) continue;
        atomic_store_explicit(&ranges[i].faults, 0, memory_order_relaxed);
        atomic_store_explicit(&ranges[i].end, start + length, memory_order_release);
        atomic_store_explicit(&ranges[i].start, start, memory_order_release);
        return i;
    }
    return -1;
}

/* The mapping of `slot` is gone: its range is no longer guarded. */
void mm3_guard_remove(int slot) {
    if (slot < 0 || slot >= SLOTS) return;
    atomic_store_explicit(&ranges[slot].start, 0, memory_order_release);
}

/* The faults read past its file's end in the mapping of `slot` since it was registered. */
long mm3_guard_faults(int slot) {
    if (slot < 0 || slot >= SLOTS) return 0;
    return atomic_load_explicit(&ranges[slot].faults, memory_order_acquire);
}

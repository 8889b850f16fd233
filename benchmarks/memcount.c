/* memcount: count the bytes a process copies in user space with memcpy and memmove.
 *
 * The independent check of transferd/copies.py (benchmarks/copies.py): loaded with
 * LD_PRELOAD into a daemon or a client, it wraps memcpy, memmove, mempcpy and their
 * _chk variants (what CPython, numpy, msgpack and uvloop call to copy buffers) and
 * adds every call of at least MEMCOUNT_MIN bytes (default 1024) to counters in the
 * file MEMCOUNT_FILE (mapped shared, so another process reads them live):
 *
 *   u64 calls, u64 bytes   (calls of at least MEMCOUNT_MIN bytes)
 *   u64 all_calls, u64 all_bytes
 *
 * Copies made by the kernel (recv_into, sendmsg) never pass through here.
 * Build: cc -O2 -shared -fPIC -fno-builtin -o memcount.so memcount.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

typedef void *(*copy_fn)(void *, const void *, size_t);
typedef void *(*copy_chk_fn)(void *, const void *, size_t, size_t);

static copy_fn real_memcpy, real_memmove, real_mempcpy;
static copy_chk_fn real_memcpy_chk, real_memmove_chk;
static volatile uint64_t *counters; /* calls, bytes, all_calls, all_bytes */
static size_t min_size = 1024;

/* Used only before the real functions are found (dlsym may copy). */
static void *slow_move(void *dst, const void *src, size_t n) {
    volatile unsigned char *d = dst;
    const volatile unsigned char *s = src;
    if (d < s) {
        for (size_t i = 0; i < n; i++) d[i] = s[i];
    } else {
        for (size_t i = n; i > 0; i--) d[i - 1] = s[i - 1];
    }
    return dst;
}

static inline void note(size_t n) {
    volatile uint64_t *c = counters;
    if (c == NULL) return;
    __atomic_add_fetch(&c[2], 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&c[3], n, __ATOMIC_RELAXED);
    if (n >= min_size) {
        __atomic_add_fetch(&c[0], 1, __ATOMIC_RELAXED);
        __atomic_add_fetch(&c[1], n, __ATOMIC_RELAXED);
    }
}

__attribute__((constructor)) static void memcount_init(void) {
    real_memcpy = (copy_fn)dlsym(RTLD_NEXT, "memcpy");
    real_memmove = (copy_fn)dlsym(RTLD_NEXT, "memmove");
    real_mempcpy = (copy_fn)dlsym(RTLD_NEXT, "mempcpy");
    real_memcpy_chk = (copy_chk_fn)dlsym(RTLD_NEXT, "__memcpy_chk");
    real_memmove_chk = (copy_chk_fn)dlsym(RTLD_NEXT, "__memmove_chk");
    const char *m = getenv("MEMCOUNT_MIN");
    if (m != NULL) min_size = (size_t)strtoull(m, NULL, 10);
    const char *path = getenv("MEMCOUNT_FILE");
    if (path == NULL) return;
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) return;
    if (ftruncate(fd, 4096) == 0) {
        void *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p != MAP_FAILED) counters = p;
    }
    close(fd);
}

void *memcpy(void *dst, const void *src, size_t n) {
    note(n);
    return real_memcpy ? real_memcpy(dst, src, n) : slow_move(dst, src, n);
}

void *memmove(void *dst, const void *src, size_t n) {
    note(n);
    return real_memmove ? real_memmove(dst, src, n) : slow_move(dst, src, n);
}

void *mempcpy(void *dst, const void *src, size_t n) {
    note(n);
    if (real_mempcpy) return real_mempcpy(dst, src, n);
    slow_move(dst, src, n);
    return (char *)dst + n;
}

void *__memcpy_chk(void *dst, const void *src, size_t n, size_t dstlen) {
    note(n);
    if (real_memcpy_chk) return real_memcpy_chk(dst, src, n, dstlen);
    return slow_move(dst, src, n);
}

void *__memmove_chk(void *dst, const void *src, size_t n, size_t dstlen) {
    note(n);
    if (real_memmove_chk) return real_memmove_chk(dst, src, n, dstlen);
    return slow_move(dst, src, n);
}

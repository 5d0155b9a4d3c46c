/* The soak's clock jumps: an LD_PRELOAD shim that moves the wall clock one process sees.

   The soak cannot step the machine's clock (other work shares it), so each service it starts runs
   with this library preloaded and the path of a small file in SOAK_CLOCK_OFFSET_FILE. The file holds
   one number, seconds to add to the wall clock (CLOCK_REALTIME and its variants, gettimeofday, time);
   the soak rewrites it to jump that process's clock and back. CLOCK_MONOTONIC is left alone, as it is
   when NTP steps a real host's clock. The file is read again at most every 200 ms (by the monotonic
   clock), with plain system calls, so a jump takes effect within 200 ms and costs nothing between.
   Built by benchmarks/soak_clock.py with the system's C compiler. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

typedef int (*clock_gettime_fn)(clockid_t, struct timespec *);

static clock_gettime_fn real_clock_gettime;
static long long offset_ns;     /* read and written with __atomic builtins */
static long long next_read_ns;  /* monotonic time of the next read of the file */

static long long to_ns(const struct timespec *ts) { return (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec; }

static long long parse_seconds_ns(const char *text) {
    /* "[-]digits[.digits]": no strtod, which may take locks or read the locale */
    long long sign = 1, whole = 0, frac = 0, scale = 1000000000LL;
    const char *p = text;
    while (*p == ' ' || *p == '+') p++;
    if (*p == '-') { sign = -1; p++; }
    while (*p >= '0' && *p <= '9') whole = whole * 10 + (*p++ - '0');
    if (*p == '.') {
        p++;
        while (*p >= '0' && *p <= '9' && scale > 1) { scale /= 10; frac += (*p++ - '0') * scale; }
    }
    return sign * (whole * 1000000000LL + frac);
}

static void refresh(void) {
    struct timespec mono;
    if (real_clock_gettime == NULL) real_clock_gettime = (clock_gettime_fn)dlsym(RTLD_NEXT, "clock_gettime");
    if (real_clock_gettime(CLOCK_MONOTONIC, &mono) != 0) return;
    long long now = to_ns(&mono);
    if (now < __atomic_load_n(&next_read_ns, __ATOMIC_RELAXED)) return;
    __atomic_store_n(&next_read_ns, now + 200000000LL, __ATOMIC_RELAXED);
    const char *path = getenv("SOAK_CLOCK_OFFSET_FILE");
    if (path == NULL) return;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    char buf[64];
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return;
    buf[n] = '\0';
    __atomic_store_n(&offset_ns, parse_seconds_ns(buf), __ATOMIC_RELAXED);
}

static int is_wall(clockid_t id) {
    return id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE || id == CLOCK_TAI;
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    refresh();
    int rc = real_clock_gettime(id, ts);
    if (rc == 0 && is_wall(id)) {
        long long t = to_ns(ts) + __atomic_load_n(&offset_ns, __ATOMIC_RELAXED);
        ts->tv_sec = t / 1000000000LL;
        ts->tv_nsec = t % 1000000000LL;
    }
    return rc;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    (void)tz;
    int rc = clock_gettime(CLOCK_REALTIME, &ts);
    if (rc == 0 && tv != NULL) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return rc;
}

time_t time(time_t *out) {
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0) return (time_t)-1;
    if (out != NULL) *out = ts.tv_sec;
    return ts.tv_sec;
}

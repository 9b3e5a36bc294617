/* delay: the link latency of a cluster in a box (tests/cluster/box.py).
 *
 *     delay [-p PRIORITY] [-q QUEUE_BYTES] LATENCY_NS PORT[=MAC] PORT[=MAC]...
 *
 * Run in the box's switch namespace in place of its bridge (the ports taken out of it): a
 * learning-free Ethernet switch between the PORTs that releases every frame LATENCY_NS
 * nanoseconds after it arrived. This kernel has no netem, so tc cannot add delay; rate
 * shaping stays with tc (tbf on both ends of each link), which this program's sends go
 * through like the bridge's.
 *
 * - Each PORT is read and written through one AF_PACKET raw socket bound to it, in
 *   promiscuous mode, with PACKET_IGNORE_OUTGOING (what it sends is not read back).
 * - A frame goes to the port whose node has the destination MAC (given as PORT=MAC; the box
 *   knows its nodes' addresses), broadcast, multicast and unknown destinations to every
 *   other port; a frame for the port it came from is dropped, as a bridge does.
 * - Per port, a receiving thread stamps each frame with its release time and appends it to
 *   that port's queue (a bounded ring of QUEUE_BYTES; full: the frame is dropped, a tail
 *   drop as in a switch), and a sending thread sleeps until the release time of the oldest
 *   (clock_nanosleep, absolute CLOCK_MONOTONIC) and sends it: frames leave in the order they
 *   came, per direction. The arrival time is the kernel's receive timestamp when it is
 *   plausible, so time a frame spent waiting for the receiving thread is not added.
 * - Both threads run SCHED_FIFO (PRIORITY, 20 by default: above every normal process,
 *   below the kernel's interrupt threads at 50): MPI ranks busy-poll, and a forwarder at
 *   normal priority waits behind them for whole scheduler slices. Memory is locked.
 * - Offloads stay on. The nodes' veths hand over TCP segments of up to 64 KiB (GSO/TSO)
 *   whose checksums are not computed yet (CHECKSUM_PARTIAL); read and written with
 *   PACKET_VNET_HDR, each frame carries a virtio_net_hdr saying so, and the kernel sends it
 *   on as the same GSO packet with the same pending checksum, as the bridge forwards it.
 *   Without it, frames beyond the MTU cannot be sent and the others arrive with bad
 *   checksums.
 *
 * Prints "ready" on stdout once every port is open; on SIGTERM, SIGINT or SIGHUP prints its
 * counts to stderr and exits 0. Needs root (CAP_NET_RAW, CAP_SYS_NICE, CAP_IPC_LOCK).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <linux/virtio_net.h>
#include <net/if.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#ifndef PACKET_IGNORE_OUTGOING
#define PACKET_IGNORE_OUTGOING 23
#endif

#define VNET_LEN ((size_t)sizeof(struct virtio_net_hdr))
#define FRAME_MAX (VNET_LEN + 65536 + 64)      /* a 64 KiB GSO packet and its headers */
#define ENTRY_LEN ((size_t)sizeof(struct entry))
#define ALIGN16(n) (((n) + 15) & ~(size_t)15)
#define NS 1000000000LL
#define PLAUSIBLE_WAIT_NS 10000000LL          /* a kernel timestamp older than this: ignored */
#define SOCKET_BUFFER (4 << 20)
#define STACK (256 << 10)
#define COUNT(field, n) __atomic_fetch_add(&(field), (n), __ATOMIC_RELAXED)
#define READ(field) __atomic_load_n(&(field), __ATOMIC_RELAXED)

/* A queued frame: this header, then the frame (virtio_net_hdr first), padded to 16 bytes.
   A header with `wrap` set ends the ring's used space: the next entry is at offset 0. */
struct entry {
    int64_t release;   /* CLOCK_MONOTONIC nanoseconds */
    uint32_t len;
    uint32_t wrap;
};

/* One port's queue: one producer (its receiving thread), one consumer (its sending thread).
   head and tail count bytes taken and put since the start; both under `lock`. */
struct ring {
    unsigned char *buf;
    size_t size;
    uint64_t head, tail;
    pthread_mutex_t lock;
    pthread_cond_t filled;
};

struct counts {
    uint64_t frames, bytes;     /* received and queued */
    uint64_t queue_full;        /* dropped: no room in the queue */
    uint64_t too_long;          /* dropped: longer than FRAME_MAX */
    uint64_t sent, send_failed; /* sends out of other ports (a flooded frame: one per port) */
    uint64_t stamped, unstamped; /* arrival from the kernel's timestamp, or from the clock */
    uint64_t wait_ns;           /* total time frames waited for the receiving thread */
    uint64_t late_ns, late_max_ns; /* how long after its release time each frame left */
};

struct port {
    const char *name;
    int index, ifindex, fd;
    unsigned char mac[ETH_ALEN];
    int has_mac;
    struct ring ring;
    unsigned char *scratch;  /* where a frame with no room in the queue is read, and dropped */
    struct counts counts;
    pthread_t rx, tx;
};

static struct port *ports;
static int nports;
static int64_t latency_ns;

static void fail(const char *what)
{
    fprintf(stderr, "delay: %s: %s\n", what, strerror(errno));
    exit(1);
}

static int64_t now_ns(clockid_t clock)
{
    struct timespec ts;
    clock_gettime(clock, &ts);
    return ts.tv_sec * NS + ts.tv_nsec;
}

static void sleep_until(int64_t when)
{
    struct timespec ts = {.tv_sec = when / NS, .tv_nsec = when % NS};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
        ;
}

/* When the frame whose receive returned now should leave: LATENCY_NS after it arrived. */
static int64_t release_time(struct port *p, struct msghdr *msg)
{
    int64_t mono = now_ns(CLOCK_MONOTONIC), real = now_ns(CLOCK_REALTIME), wait = -1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c; c = CMSG_NXTHDR(msg, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_TIMESTAMPNS) {
            struct timespec ts;
            memcpy(&ts, CMSG_DATA(c), sizeof ts);
            wait = real - (ts.tv_sec * NS + ts.tv_nsec);
        }
    }
    /* The kernel stamps with CLOCK_REALTIME; a stamp in the future or long past (a clock
       step, or a sender's monotonic departure time kept in the packet) is not used. */
    if (wait >= 0 && wait <= PLAUSIBLE_WAIT_NS) {
        COUNT(p->counts.stamped, 1);
        COUNT(p->counts.wait_ns, (uint64_t)wait);
    } else {
        COUNT(p->counts.unstamped, 1);
        wait = 0;
    }
    return mono - wait + latency_ns;
}

static void *receive(void *arg)
{
    struct port *p = arg;
    struct ring *r = &p->ring;
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(sizeof(struct timespec)) + 64];
    } control;
    struct sockaddr_ll from;

    for (;;) {
        pthread_mutex_lock(&r->lock);
        uint64_t head = r->head, tail = r->tail;
        pthread_mutex_unlock(&r->lock);
        /* room for the longest frame, contiguous: past the end, the entry starts at 0 */
        size_t off = tail % r->size;
        size_t pad = off + ENTRY_LEN + FRAME_MAX > r->size ? r->size - off : 0;
        int room = pad + ENTRY_LEN + FRAME_MAX <= r->size - (tail - head);
        size_t at = pad ? 0 : off;
        unsigned char *into = room ? r->buf + at + ENTRY_LEN : p->scratch;

        struct iovec iov = {.iov_base = into, .iov_len = FRAME_MAX};
        struct msghdr msg = {.msg_name = &from, .msg_namelen = sizeof from,
                             .msg_iov = &iov, .msg_iovlen = 1,
                             .msg_control = &control, .msg_controllen = sizeof control};
        ssize_t n = recvmsg(p->fd, &msg, MSG_TRUNC);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN)
                continue;
            fail(p->name);
        }
        if (from.sll_pkttype == PACKET_OUTGOING)
            continue;  /* PACKET_IGNORE_OUTGOING keeps these away; never forward one */
        if ((size_t)n > FRAME_MAX || (msg.msg_flags & MSG_TRUNC)) {
            COUNT(p->counts.too_long, 1);
            continue;
        }
        if ((size_t)n < VNET_LEN + ETH_HLEN)
            continue;
        if (!room) {
            COUNT(p->counts.queue_full, 1);
            continue;
        }
        struct entry *e = (struct entry *)(r->buf + at);
        e->release = release_time(p, &msg);
        e->len = (uint32_t)n;
        e->wrap = 0;
        if (pad)
            ((struct entry *)(r->buf + off))->wrap = 1;
        COUNT(p->counts.frames, 1);
        COUNT(p->counts.bytes, (uint64_t)n - VNET_LEN);
        pthread_mutex_lock(&r->lock);
        r->tail = tail + pad + ENTRY_LEN + ALIGN16((size_t)n);
        pthread_cond_signal(&r->filled);
        pthread_mutex_unlock(&r->lock);
    }
    return NULL;
}

static void send_to(struct port *from, struct port *to, const unsigned char *frame, size_t len)
{
    /* Bound socket, no address: out of `to`, through its qdisc (tc's rate). ENOBUFS is the
       qdisc dropping the frame, as it would the bridge's. */
    if (send(to->fd, frame, len, 0) < 0)
        COUNT(from->counts.send_failed, 1);
    else
        COUNT(from->counts.sent, 1);
}

static void forward(struct port *from, const unsigned char *frame, size_t len)
{
    const unsigned char *dest = frame + VNET_LEN;
    if (!(dest[0] & 1)) {  /* unicast: to its node's port when known */
        for (int k = 0; k < nports; k++) {
            if (ports[k].has_mac && memcmp(ports[k].mac, dest, ETH_ALEN) == 0) {
                if (k != from->index)
                    send_to(from, &ports[k], frame, len);
                return;
            }
        }
    }
    for (int k = 0; k < nports; k++)  /* broadcast, multicast, unknown: flooded */
        if (k != from->index)
            send_to(from, &ports[k], frame, len);
}

static void *transmit(void *arg)
{
    struct port *p = arg;
    struct ring *r = &p->ring;
    uint64_t head = 0, tail;

    for (;;) {
        pthread_mutex_lock(&r->lock);
        while (r->tail == head)
            pthread_cond_wait(&r->filled, &r->lock);
        tail = r->tail;
        pthread_mutex_unlock(&r->lock);
        while (head != tail) {
            size_t off = head % r->size;
            struct entry *e = (struct entry *)(r->buf + off);
            if (e->wrap) {
                head += r->size - off;
                continue;
            }
            int64_t now = now_ns(CLOCK_MONOTONIC);
            if (now < e->release) {
                sleep_until(e->release);
                now = now_ns(CLOCK_MONOTONIC);
            }
            uint64_t late = (uint64_t)(now - e->release);
            COUNT(p->counts.late_ns, late);
            if (late > READ(p->counts.late_max_ns))
                __atomic_store_n(&p->counts.late_max_ns, late, __ATOMIC_RELAXED);
            forward(p, r->buf + off + ENTRY_LEN, e->len);
            head += ENTRY_LEN + ALIGN16((size_t)e->len);
            pthread_mutex_lock(&r->lock);
            r->head = head;  /* room for the receiving thread, frame by frame */
            pthread_mutex_unlock(&r->lock);
        }
    }
    return NULL;
}

static void open_port(struct port *p)
{
    int one = 1, size = SOCKET_BUFFER;
    p->ifindex = (int)if_nametoindex(p->name);
    if (p->ifindex == 0)
        fail(p->name);
    /* protocol 0: nothing is received until bind() names the port and ETH_P_ALL (a socket
       opened with ETH_P_ALL would queue every interface's frames until then) */
    p->fd = socket(AF_PACKET, SOCK_RAW, 0);
    if (p->fd < 0)
        fail("socket(AF_PACKET)");
    if (setsockopt(p->fd, SOL_PACKET, PACKET_VNET_HDR, &one, sizeof one) < 0)
        fail("PACKET_VNET_HDR");
    if (setsockopt(p->fd, SOL_PACKET, PACKET_IGNORE_OUTGOING, &one, sizeof one) < 0)
        fail("PACKET_IGNORE_OUTGOING");
    if (setsockopt(p->fd, SOL_SOCKET, SO_RCVBUFFORCE, &size, sizeof size) < 0)
        fail("SO_RCVBUFFORCE");
    if (setsockopt(p->fd, SOL_SOCKET, SO_SNDBUFFORCE, &size, sizeof size) < 0)
        fail("SO_SNDBUFFORCE");
    if (setsockopt(p->fd, SOL_SOCKET, SO_TIMESTAMPNS, &one, sizeof one) < 0)
        fail("SO_TIMESTAMPNS");
    struct sockaddr_ll at = {.sll_family = AF_PACKET, .sll_protocol = htons(ETH_P_ALL),
                             .sll_ifindex = p->ifindex};
    if (bind(p->fd, (struct sockaddr *)&at, sizeof at) < 0)
        fail(p->name);
    struct packet_mreq promisc = {.mr_ifindex = p->ifindex, .mr_type = PACKET_MR_PROMISC};
    if (setsockopt(p->fd, SOL_PACKET, PACKET_ADD_MEMBERSHIP, &promisc, sizeof promisc) < 0)
        fail("PACKET_MR_PROMISC");
}

static void start(pthread_t *thread, void *(*body)(void *), struct port *p, int priority,
                  const char *role)
{
    pthread_attr_t attr;
    struct sched_param param = {.sched_priority = priority};
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, STACK);
    pthread_attr_setinheritsched(&attr, PTHREAD_EXPLICIT_SCHED);
    pthread_attr_setschedpolicy(&attr, SCHED_FIFO);
    pthread_attr_setschedparam(&attr, &param);
    int err = pthread_create(thread, &attr, body, p);
    if (err) {
        fprintf(stderr, "delay: cannot start a SCHED_FIFO thread (priority %d): %s%s\n",
                priority, strerror(err),
                err == EPERM ? " (needs root, and real-time time in this cgroup)" : "");
        exit(1);
    }
    pthread_attr_destroy(&attr);
    char name[16];
    snprintf(name, sizeof name, "%s %s", role, p->name);
    pthread_setname_np(*thread, name);
}

static void report(void)
{
    for (int k = 0; k < nports; k++) {
        struct port *p = &ports[k];
        struct counts *c = &p->counts;
        struct tpacket_stats kernel = {0};
        socklen_t len = sizeof kernel;
        getsockopt(p->fd, SOL_PACKET, PACKET_STATISTICS, &kernel, &len);
        uint64_t frames = READ(c->frames), stamped = READ(c->stamped);
        fprintf(stderr,
                "delay: from %s: %llu frames (%llu bytes), %llu sends (%llu failed), dropped "
                "%llu (queue full) %llu (too long) %u (by the kernel); waited for the "
                "receiver %.1f us on average (%llu of %llu stamped); sent late by %.1f us on "
                "average, %.1f us at most\n",
                p->name, (unsigned long long)frames, (unsigned long long)READ(c->bytes),
                (unsigned long long)READ(c->sent), (unsigned long long)READ(c->send_failed),
                (unsigned long long)READ(c->queue_full), (unsigned long long)READ(c->too_long),
                kernel.tp_drops,
                stamped ? (double)READ(c->wait_ns) / 1e3 / (double)stamped : 0.0,
                (unsigned long long)stamped, (unsigned long long)frames,
                frames ? (double)READ(c->late_ns) / 1e3 / (double)frames : 0.0,
                (double)READ(c->late_max_ns) / 1e3);
    }
}

static void usage(void)
{
    fprintf(stderr, "usage: delay [-p PRIORITY] [-q QUEUE_BYTES] LATENCY_NS "
                    "PORT[=MAC] PORT[=MAC]...\n");
    exit(2);
}

static long long number(const char *text, long long low, long long high)
{
    char *end;
    errno = 0;
    long long value = strtoll(text, &end, 10);
    if (errno || end == text || *end || value < low || value > high) {
        fprintf(stderr, "delay: %s: expected a whole number from %lld to %lld\n", text, low,
                high);
        exit(2);
    }
    return value;
}

int main(int argc, char **argv)
{
    int priority = 20, opt;
    size_t queue = 4 << 20;
    while ((opt = getopt(argc, argv, "p:q:")) != -1) {
        if (opt == 'p')
            priority = (int)number(optarg, 1, 99);
        else if (opt == 'q')
            queue = (size_t)number(optarg, 4 * (ENTRY_LEN + FRAME_MAX), 1LL << 30);
        else
            usage();
    }
    if (argc - optind < 3)
        usage();
    latency_ns = number(argv[optind++], 0, NS);
    queue = ALIGN16(queue);
    nports = argc - optind;
    ports = calloc((size_t)nports, sizeof *ports);
    if (!ports)
        fail("calloc");

    for (int k = 0; k < nports; k++) {
        struct port *p = &ports[k];
        char *spec = argv[optind + k], *eq = strchr(spec, '=');
        p->index = k;
        p->name = spec;
        if (eq) {
            *eq = '\0';
            unsigned char *m = p->mac;
            char end;
            if (sscanf(eq + 1, "%2hhx:%2hhx:%2hhx:%2hhx:%2hhx:%2hhx%c", &m[0], &m[1], &m[2],
                       &m[3], &m[4], &m[5], &end) != 6) {
                fprintf(stderr, "delay: %s: expected a MAC address as 02:00:0a:d5:00:01\n",
                        eq + 1);
                exit(2);
            }
            p->has_mac = 1;
        }
        if (!*p->name || strlen(p->name) >= IF_NAMESIZE)
            usage();
        open_port(p);
        struct ring *r = &p->ring;
        r->size = queue;
        r->buf = aligned_alloc(64, queue);
        p->scratch = malloc(FRAME_MAX);
        if (!r->buf || !p->scratch)
            fail("aligned_alloc");
        memset(r->buf, 0, queue);  /* touched now, not at the first frames */
        pthread_mutex_init(&r->lock, NULL);
        pthread_cond_init(&r->filled, NULL);
    }

    if (mlockall(MCL_CURRENT | MCL_FUTURE) < 0)
        fprintf(stderr, "delay: mlockall: %s (going on unlocked)\n", strerror(errno));
    sigset_t stop;
    sigemptyset(&stop);
    sigaddset(&stop, SIGTERM);
    sigaddset(&stop, SIGINT);
    sigaddset(&stop, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &stop, NULL);  /* the threads inherit it: only sigwait sees */
    for (int k = 0; k < nports; k++) {
        start(&ports[k].tx, transmit, &ports[k], priority, "tx");
        start(&ports[k].rx, receive, &ports[k], priority, "rx");
    }
    printf("ready\n");
    fflush(stdout);

    int sig;
    sigwait(&stop, &sig);
    report();
    return 0;
}

/*
 * nbd-reconnect: keeps a netlink-attached /dev/nbdN alive across restarts of its server.
 *
 * Usage: nbd-reconnect [-d DEAD_SECS] [-f] SOCKET EXPORT /dev/nbdN
 *
 * nbd-client 3.24 configures a device through netlink and exits: when the server goes away
 * nothing gives the kernel a new connection, and requests fail. This helper does that part.
 * It sets the device's dead-connection timeout (the kernel then holds requests while no
 * connection is alive, instead of failing them), listens for the kernel's link-dead
 * notification, and on each one connects to SOCKET (a Unix socket), negotiates EXPORT with
 * NBD_OPT_GO and hands the kernel the new socket with NBD_CMD_RECONFIGURE. Requests that
 * were in flight on the dead connection are sent again by the kernel once the request
 * timeout (nbd-client -timeout) expires them, so the device needs one.
 *
 * It forks into the background once the device is set up (-f keeps it in the foreground),
 * so that a caller knows it listens when it returns, and exits when the device is detached.
 * Messages go to stderr, one line each. Built static by scripts/vm-tests.sh for the test
 * VM's initramfs; it depends on nothing but the C library and the kernel's uapi headers.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/genetlink.h>
#include <linux/nbd-netlink.h>
#include <linux/netlink.h>
#include <poll.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define NBD_MAGIC 0x4e42444d41474943ULL     /* "NBDMAGIC" */
#define NBD_OPTS_MAGIC 0x49484156454f5054ULL /* "IHAVEOPT" */
#define NBD_REP_MAGIC 0x0003e889045565a9ULL
#define NBD_FLAG_FIXED_NEWSTYLE 1
#define NBD_FLAG_NO_ZEROES 2
#define NBD_OPT_GO 7
#define NBD_REP_ACK 1
#define NBD_REP_INFO 3
#define NBD_REP_FLAG_ERROR 0x80000000u
#define NBD_INFO_EXPORT 0

static const char *prog = "nbd-reconnect";
static char devname[32];

static void say(const char *fmt, ...)
{
    va_list ap;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    fprintf(stderr, "%s %s [%ld.%03ld]: ", prog, devname, (long)ts.tv_sec, ts.tv_nsec / 1000000);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

static long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000L + ts.tv_nsec / 1000000;
}

/* ---- generic netlink -------------------------------------------------------------------- */

struct msg {
    char buf[1024];
    struct nlmsghdr *nh;
};

static void msg_init(struct msg *m, uint16_t family, uint8_t cmd)
{
    memset(m->buf, 0, sizeof m->buf);
    m->nh = (struct nlmsghdr *)m->buf;
    m->nh->nlmsg_len = NLMSG_LENGTH(GENL_HDRLEN);
    m->nh->nlmsg_type = family;
    m->nh->nlmsg_flags = NLM_F_REQUEST | NLM_F_ACK;
    struct genlmsghdr *g = NLMSG_DATA(m->nh);
    g->cmd = cmd;
    g->version = 1;
}

/* Appends an attribute; returns it, so that a nested one can be closed by nest_end. */
static struct nlattr *put(struct msg *m, uint16_t type, const void *data, size_t len)
{
    struct nlattr *a = (struct nlattr *)(m->buf + NLMSG_ALIGN(m->nh->nlmsg_len));
    a->nla_type = type;
    a->nla_len = NLA_HDRLEN + len;
    if (len)
        memcpy((char *)a + NLA_HDRLEN, data, len);
    m->nh->nlmsg_len = NLMSG_ALIGN(m->nh->nlmsg_len) + NLA_ALIGN(a->nla_len);
    return a;
}

static void nest_end(struct msg *m, struct nlattr *a)
{
    a->nla_len = (uint16_t)(m->buf + m->nh->nlmsg_len - (char *)a);
}

static void put_u32(struct msg *m, uint16_t type, uint32_t v) { put(m, type, &v, sizeof v); }
static void put_u64(struct msg *m, uint16_t type, uint64_t v) { put(m, type, &v, sizeof v); }

/* Sends M on FD and waits for the kernel's answer; returns 0, or a negative errno. If REPLY
 * is given the first non-error answer is copied into it. */
static int transact(int fd, struct msg *m, char *reply, size_t reply_len)
{
    static uint32_t seq;
    struct sockaddr_nl kernel = {.nl_family = AF_NETLINK};
    m->nh->nlmsg_seq = ++seq;
    if (sendto(fd, m->buf, m->nh->nlmsg_len, 0, (struct sockaddr *)&kernel, sizeof kernel) < 0)
        return -errno;
    char buf[8192];
    for (;;) {
        ssize_t n = recv(fd, buf, sizeof buf, 0);
        if (n < 0)
            return -errno;
        for (struct nlmsghdr *h = (struct nlmsghdr *)buf; NLMSG_OK(h, (size_t)n); h = NLMSG_NEXT(h, n)) {
            if (h->nlmsg_seq != seq)
                continue;
            if (h->nlmsg_type == NLMSG_ERROR) {
                struct nlmsgerr *e = NLMSG_DATA(h);
                return e->error;
            }
            if (reply) {
                memcpy(reply, h, h->nlmsg_len < reply_len ? h->nlmsg_len : reply_len);
                reply = NULL;
            }
        }
    }
}

/* The nbd family's id and the id of its multicast group, from the generic netlink
 * controller. Returns 0, or -1 if the kernel has no "nbd" family (the module not loaded). */
static int resolve(int fd, uint16_t *family, uint32_t *group)
{
    struct msg m;
    char reply[8192];
    msg_init(&m, GENL_ID_CTRL, CTRL_CMD_GETFAMILY);
    put(&m, CTRL_ATTR_FAMILY_NAME, NBD_GENL_FAMILY_NAME, sizeof NBD_GENL_FAMILY_NAME);
    memset(reply, 0, sizeof reply);
    int err = transact(fd, &m, reply, sizeof reply);
    if (err < 0)
        return -1;
    struct nlmsghdr *h = (struct nlmsghdr *)reply;
    *family = 0;
    *group = 0;
    int len = h->nlmsg_len - NLMSG_LENGTH(GENL_HDRLEN);
    struct nlattr *a = (struct nlattr *)((char *)NLMSG_DATA(h) + GENL_HDRLEN);
    for (; len >= NLA_HDRLEN && a->nla_len >= NLA_HDRLEN && a->nla_len <= len;
         len -= NLA_ALIGN(a->nla_len), a = (struct nlattr *)((char *)a + NLA_ALIGN(a->nla_len))) {
        if (a->nla_type == CTRL_ATTR_FAMILY_ID)
            *family = *(uint16_t *)((char *)a + NLA_HDRLEN);
        if ((a->nla_type & NLA_TYPE_MASK) != CTRL_ATTR_MCAST_GROUPS)
            continue;
        /* A list of nested groups, each with a name and an id. */
        int glen = a->nla_len - NLA_HDRLEN;
        struct nlattr *g = (struct nlattr *)((char *)a + NLA_HDRLEN);
        for (; glen >= NLA_HDRLEN && g->nla_len >= NLA_HDRLEN && g->nla_len <= glen;
             glen -= NLA_ALIGN(g->nla_len), g = (struct nlattr *)((char *)g + NLA_ALIGN(g->nla_len))) {
            int flen = g->nla_len - NLA_HDRLEN;
            const char *name = NULL;
            uint32_t id = 0;
            struct nlattr *f = (struct nlattr *)((char *)g + NLA_HDRLEN);
            for (; flen >= NLA_HDRLEN && f->nla_len >= NLA_HDRLEN && f->nla_len <= flen;
                 flen -= NLA_ALIGN(f->nla_len), f = (struct nlattr *)((char *)f + NLA_ALIGN(f->nla_len))) {
                if (f->nla_type == CTRL_ATTR_MCAST_GRP_NAME)
                    name = (char *)f + NLA_HDRLEN;
                if (f->nla_type == CTRL_ATTR_MCAST_GRP_ID)
                    id = *(uint32_t *)((char *)f + NLA_HDRLEN);
            }
            if (name && strcmp(name, NBD_GENL_MCAST_GROUP_NAME) == 0)
                *group = id;
        }
    }
    return *family && *group ? 0 : -1;
}

/* ---- the NBD handshake ------------------------------------------------------------------ */

static int read_all(int fd, void *buf, size_t len)
{
    char *p = buf;
    while (len) {
        ssize_t n = read(fd, p, len);
        if (n <= 0)
            return -1;
        p += n;
        len -= n;
    }
    return 0;
}

static int write_all(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len) {
        ssize_t n = write(fd, p, len);
        if (n <= 0)
            return -1;
        p += n;
        len -= n;
    }
    return 0;
}

static uint64_t be64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = v << 8 | p[i];
    return v;
}

static uint32_t be32(const unsigned char *p) { return (uint32_t)p[0] << 24 | p[1] << 16 | p[2] << 8 | p[3]; }

static void put_be32(unsigned char *p, uint32_t v)
{
    for (int i = 3; i >= 0; i--, v >>= 8)
        p[i] = v & 0xff;
}

static void put_be64(unsigned char *p, uint64_t v)
{
    for (int i = 7; i >= 0; i--, v >>= 8)
        p[i] = v & 0xff;
}

/* Connects to PATH and negotiates EXPORT (fixed newstyle, NBD_OPT_GO); returns the socket,
 * in the transmission phase, or -1 with the reason in WHY. The export must still have SIZE
 * bytes: the kernel keeps the size it was given at attach time. */
static int handshake(const char *path, const char *export, uint64_t size, const char **why)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        *why = "socket";
        return -1;
    }
    /* Bounded while negotiating; cleared before the kernel gets the socket, whose reads
     * would otherwise time out too. */
    struct timeval tv = {.tv_sec = 5};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    unsigned char hello[18], opt[16 + 4 + 256 + 2], rep[20];
    size_t name_len = strlen(export);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
        *why = "connect";
        goto fail;
    }
    if (read_all(fd, hello, sizeof hello) < 0) {
        *why = "no greeting (the connection closed)";
        goto fail;
    }
    uint16_t hflags = hello[16] << 8 | hello[17];
    if (be64(hello) != NBD_MAGIC || be64(hello + 8) != NBD_OPTS_MAGIC || !(hflags & NBD_FLAG_FIXED_NEWSTYLE)) {
        *why = "not a fixed-newstyle NBD server";
        goto fail;
    }
    unsigned char cflags[4];
    put_be32(cflags, NBD_FLAG_FIXED_NEWSTYLE | (hflags & NBD_FLAG_NO_ZEROES));
    if (name_len > 256) {
        *why = "export name too long";
        goto fail;
    }
    put_be64(opt, NBD_OPTS_MAGIC);
    put_be32(opt + 8, NBD_OPT_GO);
    put_be32(opt + 12, 4 + name_len + 2);
    put_be32(opt + 16, name_len);
    memcpy(opt + 20, export, name_len);
    opt[20 + name_len] = opt[21 + name_len] = 0; /* no information requests */
    if (write_all(fd, cflags, 4) < 0 || write_all(fd, opt, 22 + name_len) < 0) {
        *why = "write";
        goto fail;
    }
    uint64_t got_size = UINT64_MAX;
    for (;;) {
        if (read_all(fd, rep, sizeof rep) < 0 || be64(rep) != NBD_REP_MAGIC) {
            *why = "bad or no option reply";
            goto fail;
        }
        uint32_t type = be32(rep + 12), len = be32(rep + 16);
        unsigned char data[1024];
        if (len > sizeof data || read_all(fd, data, len) < 0) {
            *why = "option reply too long or cut short";
            goto fail;
        }
        if (type & NBD_REP_FLAG_ERROR) {
            *why = "the server refused NBD_OPT_GO";
            goto fail;
        }
        if (type == NBD_REP_INFO && len >= 12 && (data[0] << 8 | data[1]) == NBD_INFO_EXPORT)
            got_size = be64(data + 2);
        if (type == NBD_REP_ACK)
            break;
    }
    if (got_size != size) {
        *why = "the export's size changed";
        goto fail;
    }
    tv.tv_sec = 0;
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return fd;
fail:
    close(fd);
    return -1;
}

/* ---- the device ------------------------------------------------------------------------- */

static int attached(int index)
{
    char path[64];
    snprintf(path, sizeof path, "/sys/block/nbd%d/pid", index);
    return access(path, F_OK) == 0;
}

static uint64_t device_size(int index)
{
    char path[64];
    unsigned long long sectors = 0;
    snprintf(path, sizeof path, "/sys/block/nbd%d/size", index);
    FILE *f = fopen(path, "r");
    if (f) {
        if (fscanf(f, "%llu", &sectors) != 1)
            sectors = 0;
        fclose(f);
    }
    return (uint64_t)sectors * 512;
}

/* Hands the kernel a new connection for device INDEX, retrying until DEADLINE (ms). */
static void reconnect(int nl, uint16_t family, int index, const char *path, const char *export, uint64_t size,
                      long deadline)
{
    long t0 = now_ms();
    int attempts = 0;
    const char *why = "";
    while (now_ms() < deadline && attached(index)) {
        attempts++;
        int sock = handshake(path, export, size, &why);
        if (sock >= 0) {
            struct msg m;
            msg_init(&m, family, NBD_CMD_RECONFIGURE);
            put_u32(&m, NBD_ATTR_INDEX, index);
            struct nlattr *socks = put(&m, NBD_ATTR_SOCKETS | NLA_F_NESTED, NULL, 0);
            struct nlattr *item = put(&m, NBD_SOCK_ITEM | NLA_F_NESTED, NULL, 0);
            put_u32(&m, NBD_SOCK_FD, sock);
            nest_end(&m, item);
            nest_end(&m, socks);
            int err = transact(nl, &m, NULL, 0);
            close(sock); /* the kernel holds its own reference */
            if (err == 0) {
                say("reconnected after %ld ms (%d attempts)", now_ms() - t0, attempts);
                return;
            }
            say("NBD_CMD_RECONFIGURE with the new socket failed: %s", strerror(-err));
        }
        struct timespec pause = {.tv_nsec = 200 * 1000000L};
        nanosleep(&pause, NULL);
    }
    say("gave up after %ld ms (%d attempts, last: %s)", now_ms() - t0, attempts, why);
}

int main(int argc, char **argv)
{
    int dead_secs = 60, foreground = 0, c;
    while ((c = getopt(argc, argv, "d:f")) != -1) {
        if (c == 'd')
            dead_secs = atoi(optarg);
        else if (c == 'f')
            foreground = 1;
        else
            goto usage;
    }
    if (argc - optind != 3 || dead_secs <= 0) {
    usage:
        fprintf(stderr, "usage: %s [-d DEAD_SECS] [-f] SOCKET EXPORT /dev/nbdN\n", prog);
        return 2;
    }
    const char *path = argv[optind], *export = argv[optind + 1], *dev = argv[optind + 2];
    int index;
    if (sscanf(dev, "/dev/nbd%d", &index) != 1 || index < 0) {
        fprintf(stderr, "%s: %s is not /dev/nbdN\n", prog, dev);
        return 2;
    }
    snprintf(devname, sizeof devname, "nbd%d", index);
    uint64_t size = device_size(index);
    if (!attached(index) || size == 0) {
        say("not attached");
        return 1;
    }

    /* One socket for requests, one for the notifications, so that an answer is never
     * mistaken for an event or the other way round. */
    int nl = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_GENERIC);
    int ev = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_GENERIC);
    struct sockaddr_nl local = {.nl_family = AF_NETLINK};
    if (nl < 0 || ev < 0 || bind(nl, (struct sockaddr *)&local, sizeof local) < 0 ||
        bind(ev, (struct sockaddr *)&local, sizeof local) < 0) {
        say("netlink socket: %s", strerror(errno));
        return 1;
    }
    uint16_t family;
    uint32_t group;
    if (resolve(nl, &family, &group) < 0) {
        say("no \"nbd\" generic netlink family with a \"%s\" group (is nbd loaded?)", NBD_GENL_MCAST_GROUP_NAME);
        return 1;
    }
    if (setsockopt(ev, SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, &group, sizeof group) < 0) {
        say("joining the nbd multicast group: %s", strerror(errno));
        return 1;
    }
    struct msg m;
    msg_init(&m, family, NBD_CMD_RECONFIGURE);
    put_u32(&m, NBD_ATTR_INDEX, index);
    put_u64(&m, NBD_ATTR_DEAD_CONN_TIMEOUT, dead_secs);
    int err = transact(nl, &m, NULL, 0);
    if (err < 0) {
        say("setting the dead-connection timeout: %s", strerror(-err));
        return 1;
    }
    say("dead-connection timeout %d s; watching for link-dead notifications", dead_secs);
    if (!foreground) {
        pid_t pid = fork();
        if (pid < 0) {
            say("fork: %s", strerror(errno));
            return 1;
        }
        if (pid > 0)
            return 0;
        setsid();
    }

    for (;;) {
        struct pollfd p = {.fd = ev, .events = POLLIN};
        int r = poll(&p, 1, 1000);
        if (!attached(index)) {
            say("detached; exiting");
            return 0;
        }
        if (r <= 0)
            continue;
        char buf[8192];
        ssize_t n = recv(ev, buf, sizeof buf, 0);
        if (n < 0) {
            /* ENOBUFS: notifications were dropped; one may have been ours. */
            say("notification socket: %s; reconnecting in case", strerror(errno));
            reconnect(nl, family, index, path, export, size, now_ms() + dead_secs * 1000L);
            continue;
        }
        for (struct nlmsghdr *h = (struct nlmsghdr *)buf; NLMSG_OK(h, (size_t)n); h = NLMSG_NEXT(h, n)) {
            if (h->nlmsg_type != family)
                continue;
            struct genlmsghdr *g = NLMSG_DATA(h);
            if (g->cmd != NBD_CMD_LINK_DEAD)
                continue;
            int len = h->nlmsg_len - NLMSG_LENGTH(GENL_HDRLEN);
            struct nlattr *a = (struct nlattr *)((char *)g + GENL_HDRLEN);
            int which = -1;
            for (; len >= NLA_HDRLEN && a->nla_len >= NLA_HDRLEN && a->nla_len <= len;
                 len -= NLA_ALIGN(a->nla_len), a = (struct nlattr *)((char *)a + NLA_ALIGN(a->nla_len)))
                if (a->nla_type == NBD_ATTR_INDEX)
                    which = *(uint32_t *)((char *)a + NLA_HDRLEN);
            if (which != index)
                continue;
            say("link dead");
            reconnect(nl, family, index, path, export, size, now_ms() + dead_secs * 1000L);
        }
    }
}

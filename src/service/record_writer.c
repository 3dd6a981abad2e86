/* SPDX-License-Identifier: Apache-2.0 */
/* The background JSONL writer of decision and outcome records (include/kvmatch/records.h,
 * docs/RECORDS.md).
 *
 * Submitters copy a line, or a record struct with everything it points to (one allocation), into a
 * bounded ring under a mutex held only for the pointer updates; one thread takes everything queued
 * at once, formats the records, and copies the lines into a buffer that goes to the file when
 * full, when flush_interval_ms has passed since its first line, or on flush / destroy. The
 * buffer never spans a rotation, and a failed write is truncated back to the last whole line,
 * so no line is ever split or half-written. I/O failures are counted and logged on the transition
 * (failing, recovered), never fatal: the file is closed and reopened for the next line. */
#include "kvmatch/log.h"
#include "kvmatch/records.h"
#include "base/log_level.h"
#include "base/utf8.h"
#include "service/records_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* What a queue slot holds: a line, or a deep copy of a record to be formatted by the writer. */
typedef enum queued_kind {
    QUEUED_LINE = 0,     /* data: the line's bytes, len of them */
    QUEUED_DECISION = 1, /* data: a km_decision_record with everything it points to, len bytes */
    QUEUED_OUTCOME = 2,  /* data: a km_outcome_record likewise */
} queued_kind;

typedef struct queued_line {
    char *data;
    size_t len;
    queued_kind kind;
} queued_line;

struct km_record_writer {
    km_record_writer_config config; /* path points to path_copy */
    char *path_copy;
    char *rotate_from, *rotate_to; /* scratch for rotated names */
    size_t rotate_name_size;

    pthread_mutex_t lock;
    pthread_cond_t work;  /* the writer thread waits here */
    pthread_cond_t done;  /* flushers wait here */
    pthread_t thread;

    /* under lock */
    queued_line *ring;
    uint32_t head, count;
    uint64_t queued_bytes;
    bool stopping;
    uint64_t submitted, dropped, written, failed, invalid, bytes, rotations, write_errors;
    uint64_t deleted_files, deleted_records, deleted_bytes; /* by retention, at rotations */
    uint64_t flush_target;   /* highest `submitted` a flusher waits for */
    uint64_t synced_through; /* lines (written + failed + invalid) covered by the last fdatasync */
    uint64_t failed_at_last_flush, sync_failures, sync_failures_at_last_flush;
    uint64_t invalid_at_last_flush;
    int last_error_status;
    char last_error[KM_RECORD_WRITER_ERROR_BYTES];
    bool failing_now; /* `failing`, for km_record_writer_stats */
    bool reopen_requested; /* km_record_writer_reopen: close the file once the lines submitted
                            * before it are written */
    uint32_t reopen_lines; /* of the queue, the lines submitted before the reopen */

    /* writer thread only */
    int fd;
    bool regular_file;  /* rotation and truncation only for regular files */
    uint64_t file_bytes;
    uint64_t rotation_base; /* file_bytes when a rotation failed: the next try waits for another
                             * max_file_bytes, so a failing rename is not retried on every line */
    char *buf;
    size_t buf_len, buf_cap;
    uint64_t buf_lines;
    int64_t buf_deadline_ns;
    bool failing; /* the last I/O operation failed (log on transitions only) */
    bool before_reopen; /* the lines being written were submitted before a reopen */
    int64_t fifo_give_up_ns; /* once stopping: when FIFO waits give up (fifo_wait); 0 before */
    bool fifo_waiting;       /* waiting for a FIFO's reader, and said so */
};

void km_record_writer_config_init(km_record_writer_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->max_file_bytes = UINT64_C(256) << 20;
    cfg->keep_files = 8;
    cfg->queue_capacity = 65536;
    cfg->max_queue_bytes = UINT64_C(64) << 20;
    cfg->max_line_bytes = UINT64_C(1) << 20;
    cfg->flush_interval_ms = 200;
}

/* Lines are written once this many are waiting (or flush_interval_ms passed). */
#define WRITE_BATCH_BYTES ((size_t)1 << 20)

static void writer_log(km_record_writer *w, const char *line)
{
    if (w->config.log)
        w->config.log(w->config.log_user, line);
    else
        fprintf(stderr, "kvmatch: records: %s\n", line + km_log_level_length(line));
}

/* Count an I/O failure: stats, last_error, and one log line when the writer starts failing.
 * Takes the lock. */
static void io_failure(km_record_writer *w, const char *what, const char *name, int err)
{
    char sentence[512];
    snprintf(sentence, sizeof sentence, "%s: %s %s: %s", km_error_name(KM_ERR_IO), what, name,
             strerror(err));
    pthread_mutex_lock(&w->lock);
    w->write_errors++;
    w->failing_now = true;
    w->last_error_status = KM_ERR_IO;
    snprintf(w->last_error, sizeof w->last_error, "%s", sentence);
    pthread_mutex_unlock(&w->lock);
    if (!w->failing) {
        char line[600];
        snprintf(line, sizeof line, KM_LOG_ERROR
                 "%s (records are counted as failed until a write succeeds)",
                 sentence);
        writer_log(w, line);
    }
    w->failing = true;
}

static void io_success(km_record_writer *w)
{
    if (w->failing) {
        pthread_mutex_lock(&w->lock);
        w->failing_now = false;
        pthread_mutex_unlock(&w->lock);
        char line[600];
        snprintf(line, sizeof line, KM_LOG_INFO "writing %s again", w->config.path);
        writer_log(w, line);
    }
    w->failing = false;
}

static void close_file(km_record_writer *w)
{
    if (w->fd >= 0)
        close(w->fd);
    w->fd = -1;
}

static void sync_file(km_record_writer *w, bool *sync_failed)
{
    if (w->fd < 0)
        return;
    if (fdatasync(w->fd) != 0 && errno != EINVAL && errno != EROFS) {
        /* EINVAL: a FIFO or special file, which has nothing to sync */
        io_failure(w, "fdatasync", w->config.path, errno);
        *sync_failed = true;
    }
}

/* Sync the open file before it is closed (a rotation, a reopen, a path moved away): a later flush
 * syncs only the file open then, so the lines written here must reach the disk now. A failure is
 * counted and fails the next flush (KM_ERR_IO). */
static void sync_and_close(km_record_writer *w)
{
    bool sync_failed = false;
    sync_file(w, &sync_failed);
    if (sync_failed) {
        pthread_mutex_lock(&w->lock);
        w->sync_failures++;
        pthread_mutex_unlock(&w->lock);
    }
    close_file(w);
}

/* A FIFO is opened and written without blocking: while it has no reader (open: ENXIO) or its
 * pipe is full (write: EAGAIN) the writer waits, in slices of FIFO_WAIT_SLICE_MS, as a blocking
 * open or write would, and the queue fills meanwhile (submit drops, counted); once the writer is
 * stopping it waits at most FIFO_STOP_WAIT_MS more for room, then what is left fails (counted,
 * logged) rather than hold the stop for as long as the reader is away. */
#define FIFO_WAIT_SLICE_MS 50
#define FIFO_STOP_WAIT_MS 1000

static bool writer_stopping(km_record_writer *w)
{
    pthread_mutex_lock(&w->lock);
    bool stopping = w->stopping;
    pthread_mutex_unlock(&w->lock);
    return stopping;
}

/* Wait for a FIFO's reader to come (fd < 0) or to make room in its pipe: true to try again,
 * false once the writer has been stopping for FIFO_STOP_WAIT_MS (every later wait then gives up
 * at once). */
static bool fifo_wait(km_record_writer *w, int fd)
{
    int64_t now = km_record_clock_ns(CLOCK_MONOTONIC);
    if (writer_stopping(w)) {
        if (w->fifo_give_up_ns == 0)
            w->fifo_give_up_ns = now + (int64_t)FIFO_STOP_WAIT_MS * 1000000;
        else if (now >= w->fifo_give_up_ns)
            return false;
    }
    if (fd < 0) {
        struct timespec pause = {0, FIFO_WAIT_SLICE_MS * 1000000L};
        nanosleep(&pause, NULL);
    } else {
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        (void)poll(&p, 1, FIFO_WAIT_SLICE_MS);
    }
    return true;
}

/* open() failed with ENXIO on a FIFO (no reader yet, rather than a socket or a device without
 * its driver, which fail at once): say so once per wait, then wait for the reader. */
static bool fifo_reader_wait(km_record_writer *w)
{
    struct stat st;
    if (stat(w->config.path, &st) != 0 || !S_ISFIFO(st.st_mode))
        return false;
    if (!w->fifo_waiting) {
        char line[600];
        snprintf(line, sizeof line, KM_LOG_WARNING
                 "records: the FIFO %s has no reader; records wait for one (a full queue drops "
                 "them, counted)", w->config.path);
        writer_log(w, line);
        w->fifo_waiting = true;
    }
    return fifo_wait(w, -1);
}

/* Open (create) the file for appending; make sure it ends with a newline. */
static bool open_file(km_record_writer *w)
{
    if (w->fd >= 0)
        return true;
    int fd;
    while ((fd = open(w->config.path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NONBLOCK,
                      0644)) < 0 &&
           errno == ENXIO && fifo_reader_wait(w))
        ;
    if (fd >= 0)
        w->fifo_waiting = false;
    if (fd < 0) {
        io_failure(w, "open", w->config.path, errno);
        return false;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        io_failure(w, "fstat", w->config.path, errno);
        close(fd);
        return false;
    }
    w->fd = fd;
    w->regular_file = S_ISREG(st.st_mode);
    w->file_bytes = w->regular_file ? (uint64_t)st.st_size : 0;
    if (w->regular_file && st.st_size > 0) {
        /* a crash mid-line left a partial record: start ours on a line of its own */
        int rfd = open(w->config.path, O_RDONLY | O_CLOEXEC);
        char last = '\n';
        if (rfd >= 0) {
            if (pread(rfd, &last, 1, st.st_size - 1) != 1)
                last = '\n';
            close(rfd);
        }
        if (last != '\n') {
            if (write(fd, "\n", 1) != 1) {
                io_failure(w, "write", w->config.path, errno ? errno : EIO);
                close_file(w);
                return false;
            }
            w->file_bytes++;
        }
    }
    return true;
}

/* Write all of data, retrying partial writes and EINTR, and waiting for room in a full FIFO
 * (fifo_wait). 0 or an errno; *done says how many bytes reached the file either way. */
static int write_all(km_record_writer *w, int fd, const char *data, size_t len, size_t *done)
{
    *done = 0;
    while (len > 0) {
        ssize_t n = write(fd, data, len);
        if (n < 0) {
            if (errno == EINTR ||
                ((errno == EAGAIN || errno == EWOULDBLOCK) && fifo_wait(w, fd)))
                continue;
            return errno;
        }
        if (n == 0)
            return EIO;
        data += n;
        len -= (size_t)n;
        *done += (size_t)n;
    }
    return 0;
}

/* Before a write: does the path still name the open file? When the file or its directory was
 * removed or moved away (by hand, by another program's rotation), writes to the open file would
 * succeed and count as written although no reader can find them: close it, so the write reopens
 * the path (a missing directory then fails the write, counted, until it is back). The file's
 * size is refreshed too: a file truncated behind our back must not be cut back (after a failed
 * write) or rotated by the size we remembered. */
static void check_file(km_record_writer *w)
{
    if (w->fd < 0)
        return;
    struct stat by_name, open_file_st;
    bool open_ok = fstat(w->fd, &open_file_st) == 0;
    bool same = open_ok && stat(w->config.path, &by_name) == 0 &&
                by_name.st_dev == open_file_st.st_dev && by_name.st_ino == open_file_st.st_ino;
    /* Lines submitted before a reopen go to the file that was open, when it was moved (still
     * has a name): an outside rotation moved it, then asked for the reopen. */
    if (!same && !(w->before_reopen && open_ok && open_file_st.st_nlink > 0)) {
        sync_and_close(w);
        return;
    }
    if (w->regular_file)
        w->file_bytes = (uint64_t)open_file_st.st_size;
}

/* Send the buffer to the file. On failure (a full disk, a file size limit) the whole lines that
 * reached the file count as written, the rest as failed; a partial line is cut back, and the
 * file is closed (reopened for the next line). */
static void buffer_write(km_record_writer *w)
{
    if (w->buf_len == 0)
        return;
    uint64_t lines = w->buf_lines, kept_lines = 0;
    size_t len = w->buf_len, kept = 0;
    check_file(w);
    if (open_file(w)) {
        size_t done = 0;
        int err = write_all(w, w->fd, w->buf, len, &done);
        if (err == 0) {
            kept = len;
            kept_lines = lines;
            io_success(w);
        } else {
            io_failure(w, "write", w->config.path, err);
            for (size_t i = 0; i < done; i++)
                if (w->buf[i] == '\n') {
                    kept = i + 1;
                    kept_lines++;
                }
            if (w->regular_file && done > kept &&
                ftruncate(w->fd, (off_t)(w->file_bytes + kept)) != 0)
                io_failure(w, "ftruncate (cutting a partial line)", w->config.path, errno);
            sync_and_close(w);
        }
        w->file_bytes += kept;
    }
    pthread_mutex_lock(&w->lock);
    w->written += kept_lines;
    w->bytes += kept;
    w->failed += lines - kept_lines;
    pthread_mutex_unlock(&w->lock);
    w->buf_len = 0;
    w->buf_lines = 0;
    w->buf_deadline_ns = 0;
}

/* What one rotation deleted (retention), for the counters and its one log line. */
typedef struct deletion {
    uint64_t files, records, bytes;
    const char *why; /* the first rule that deleted a file */
} deletion;

/* The records (lines) and bytes of a file about to be deleted: read through once, so the count is
 * exact whoever wrote the file (this writer, an earlier run). False when it cannot be read. */
static bool count_records(km_record_writer *w, const char *name, uint64_t *records, uint64_t *bytes)
{
    *records = *bytes = 0;
    int fd = open(name, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return false;
    /* the writer's own buffer is empty at a rotation (written out first): read into it */
    bool ends_with_newline = true;
    for (;;) {
        ssize_t n = read(fd, w->buf, w->buf_cap);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            close(fd);
            *records += !ends_with_newline; /* a last line cut short is a record lost too */
            return n == 0;
        }
        for (const char *p = w->buf, *end = w->buf + n; (p = memchr(p, '\n', (size_t)(end - p)));
             p++)
            (*records)++;
        *bytes += (uint64_t)n;
        ends_with_newline = w->buf[n - 1] == '\n';
    }
}

/* Delete a file that retention gives up (counted in `d` when it existed). */
static bool retire(km_record_writer *w, const char *name, const char *why, deletion *d)
{
    uint64_t records = 0, bytes = 0;
    bool counted = count_records(w, name, &records, &bytes);
    if (unlink(name) != 0) {
        if (errno == ENOENT)
            return true;
        io_failure(w, "unlink (rotation)", name, errno);
        return false;
    }
    d->files++;
    d->records += counted ? records : 0;
    d->bytes += bytes;
    if (!d->why)
        d->why = why;
    return true;
}

/* After a rotation, path.1 .. path.keep from the newest: the first one past max_kept_bytes (all
 * rotated files together) or older than max_age_s, and every older one, are deleted. */
static void apply_retention(km_record_writer *w, deletion *d)
{
    uint64_t kept_bytes = 0;
    time_t now = time(NULL);
    const char *why = NULL;
    for (uint32_t i = 1; i <= w->config.keep_files; i++) {
        snprintf(w->rotate_from, w->rotate_name_size, "%s.%u", w->config.path, i);
        struct stat st;
        if (stat(w->rotate_from, &st) != 0)
            continue;
        if (!why && w->config.max_kept_bytes &&
            kept_bytes + (uint64_t)st.st_size > w->config.max_kept_bytes)
            why = "max_kept_bytes";
        if (!why && w->config.max_age_s && now - st.st_mtime > (time_t)w->config.max_age_s)
            why = "max_age_s";
        if (why)
            retire(w, w->rotate_from, why, d);
        else
            kept_bytes += (uint64_t)st.st_size;
    }
}

/* path -> path.1 -> ... -> path.keep (the oldest, path.keep, deleted first), or path deleted
 * (keep 0); then the byte and age limits. Every record deleted is counted and the rotation logs
 * one line saying how many. The buffer was written first. A rename that fails is counted; the
 * writer then keeps appending. */
static void rotate(km_record_writer *w)
{
    sync_and_close(w);
    uint32_t keep = w->config.keep_files;
    const char *path = w->config.path;
    bool ok = true;
    deletion d = {0, 0, 0, NULL};
    if (keep == 0) {
        ok = retire(w, path, "keep_files 0", &d);
    } else {
        snprintf(w->rotate_from, w->rotate_name_size, "%s.%u", path, keep);
        ok = retire(w, w->rotate_from, "keep_files", &d);
        for (uint32_t i = keep - 1; ok && i >= 1; i--) {
            snprintf(w->rotate_from, w->rotate_name_size, "%s.%u", path, i);
            snprintf(w->rotate_to, w->rotate_name_size, "%s.%u", path, i + 1);
            if (rename(w->rotate_from, w->rotate_to) != 0 && errno != ENOENT) {
                io_failure(w, "rename (rotation)", w->rotate_from, errno);
                ok = false;
            }
        }
        snprintf(w->rotate_to, w->rotate_name_size, "%s.1", path);
        if (ok && rename(path, w->rotate_to) != 0 && errno != ENOENT) {
            io_failure(w, "rename (rotation)", path, errno);
            ok = false;
        }
    }
    if (ok && keep > 0)
        apply_retention(w, &d);
    pthread_mutex_lock(&w->lock);
    w->rotations += ok;
    w->deleted_files += d.files;
    w->deleted_records += d.records;
    w->deleted_bytes += d.bytes;
    pthread_mutex_unlock(&w->lock);
    if (d.files) {
        char line[512];
        snprintf(line, sizeof line, KM_LOG_INFO
                 "rotation of %s deleted %" PRIu64 " file%s holding %" PRIu64
                 " records (%" PRIu64 " bytes) under %s", path, d.files, d.files == 1 ? "" : "s",
                 d.records, d.bytes, d.why);
        writer_log(w, line);
    }
    w->rotation_base = 0;
    if (open_file(w) && !ok)
        w->rotation_base = w->file_bytes;
}

/* Copy one line into the buffer, first writing the buffer out / rotating as needed. */
static void buffer_line(km_record_writer *w, const char *data, size_t len)
{
    uint64_t need = (uint64_t)len + 1;
    if (w->fd < 0 && w->buf_len == 0)
        open_file(w); /* learn the file's size for the rotation check; a failure fails at write */
    uint64_t max = w->config.max_file_bytes;
    if (max > 0 && w->fd >= 0 && w->regular_file) {
        if (w->rotation_base > w->file_bytes)
            w->rotation_base = 0; /* the file was truncated or replaced behind our back */
        uint64_t would = w->file_bytes - w->rotation_base + w->buf_len;
        if (w->file_bytes + w->buf_len > 0 && would + need > max) {
            buffer_write(w);
            /* The rotation goes by the file's size at this moment, not the size last seen: a
             * file truncated behind the writer (copytruncate) or moved away since its last write
             * is not rotated. */
            check_file(w);
            if (w->rotation_base > w->file_bytes)
                w->rotation_base = 0;
            if (w->fd >= 0 && w->file_bytes > 0 &&
                w->file_bytes - w->rotation_base + need > max)
                rotate(w);
        }
    }
    /* Written once a line would take the buffer past 1 MiB: the buffer is larger only so that one
     * line of up to max_line_bytes fits (what is kept unwritten stays about 1 MiB). */
    if (w->buf_len > 0 && w->buf_len + need > (w->buf_cap < WRITE_BATCH_BYTES ? w->buf_cap
                                                                               : WRITE_BATCH_BYTES))
        buffer_write(w);
    memcpy(w->buf + w->buf_len, data, len);
    w->buf[w->buf_len + len] = '\n';
    w->buf_len += (size_t)need;
    w->buf_lines++;
    if (w->buf_deadline_ns == 0)
        w->buf_deadline_ns =
            km_record_clock_ns(CLOCK_MONOTONIC) + (int64_t)w->config.flush_interval_ms * 1000000;
}

/* A record queued by km_record_writer_submit_decision / _outcome: format it here, off the
 * caller's thread. A record that does not format is counted as invalid, with the sentence. */
static void format_and_buffer(km_record_writer *w, const queued_line *q)
{
    char *line = NULL;
    size_t len = 0;
    char error[400];
    int rc = q->kind == QUEUED_DECISION
                 ? km_decision_record_format((const km_decision_record *)(void *)q->data, &line,
                                             &len, error, sizeof error)
                 : km_outcome_record_format((const km_outcome_record *)(void *)q->data, &line, &len,
                                            error, sizeof error);
    if (rc == KM_OK && len > w->config.max_line_bytes) {
        rc = KM_ERR_TOO_LARGE;
        snprintf(error, sizeof error, "%s: a %s record of %zu bytes (max_line_bytes %" PRIu64 ")",
                 km_error_name(rc), q->kind == QUEUED_DECISION ? "decision" : "outcome", len,
                 w->config.max_line_bytes);
    }
    if (rc == KM_OK) {
        buffer_line(w, line, len);
    } else {
        pthread_mutex_lock(&w->lock);
        w->invalid++;
        w->last_error_status = rc;
        snprintf(w->last_error, sizeof w->last_error, "record not written: %s", error);
        pthread_mutex_unlock(&w->lock);
    }
    free(line);
}

static void deadline_to_timespec(int64_t deadline_ns, struct timespec *ts)
{
    ts->tv_sec = (time_t)(deadline_ns / 1000000000);
    ts->tv_nsec = (long)(deadline_ns % 1000000000);
}

static void *writer_thread(void *arg)
{
    km_record_writer *w = arg;
    pthread_mutex_lock(&w->lock);
    for (;;) {
        while (w->count == 0 && !w->stopping && w->flush_target <= w->synced_through &&
               !w->reopen_requested) {
            if (w->buf_len > 0) {
                if (km_record_clock_ns(CLOCK_MONOTONIC) >= w->buf_deadline_ns)
                    break;
                struct timespec ts;
                deadline_to_timespec(w->buf_deadline_ns, &ts);
                pthread_cond_timedwait(&w->work, &w->lock, &ts);
            } else {
                pthread_cond_wait(&w->work, &w->lock);
            }
        }
        uint32_t n = w->count, head = w->head, capacity = w->config.queue_capacity;
        /* up to a reopen, the lines submitted before it alone */
        w->before_reopen = w->reopen_requested;
        if (w->reopen_requested && n > w->reopen_lines)
            n = w->reopen_lines;
        pthread_mutex_unlock(&w->lock);

        /* The taken lines stay counted in the queue until copied, so submitters never touch
         * these slots meanwhile. */
        uint64_t freed_bytes = 0;
        for (uint32_t i = 0; i < n; i++) {
            queued_line *q = &w->ring[(head + i) % capacity];
            if (q->kind == QUEUED_LINE)
                buffer_line(w, q->data, q->len);
            else
                format_and_buffer(w, q);
            freed_bytes += q->len;
            free(q->data);
            q->data = NULL;
        }

        pthread_mutex_lock(&w->lock);
        w->head = (head + n) % capacity;
        w->count -= n;
        w->queued_bytes -= freed_bytes;
        bool stop = w->stopping && w->count == 0;
        bool flush = w->flush_target > w->synced_through;
        if (w->reopen_requested)
            w->reopen_lines -= n;
        bool reopen = w->reopen_requested && w->reopen_lines == 0;
        if (reopen)
            w->reopen_requested = false;
        pthread_mutex_unlock(&w->lock);
        if (reopen) {
            /* what was taken goes to the old file; the next line opens the path again */
            w->before_reopen = true;
            buffer_write(w);
            sync_and_close(w);
        }
        w->before_reopen = false;

        bool due = w->buf_len > 0 && km_record_clock_ns(CLOCK_MONOTONIC) >= w->buf_deadline_ns;
        if (stop || flush || due)
            buffer_write(w);
        if (stop || flush) {
            bool sync_failed = false;
            sync_file(w, &sync_failed);
            pthread_mutex_lock(&w->lock);
            if (sync_failed)
                w->sync_failures++;
            w->synced_through = w->written + w->failed + w->invalid;
            pthread_cond_broadcast(&w->done);
            pthread_mutex_unlock(&w->lock);
        }
        if (stop)
            break;
        pthread_mutex_lock(&w->lock);
    }
    close_file(w);
    return NULL;
}

/* The handle's lock and condition variables (initialised, no thread waiting). */
static void writer_free_sync(km_record_writer *w)
{
    pthread_cond_destroy(&w->work);
    pthread_cond_destroy(&w->done);
    pthread_mutex_destroy(&w->lock);
}

/* The handle and its allocations; any of them may be NULL. */
static void writer_free_memory(km_record_writer *w)
{
    free(w->path_copy);
    free(w->rotate_from);
    free(w->rotate_to);
    free(w->ring);
    free(w->buf);
    free(w);
}

int km_record_writer_create(const km_record_writer_config *cfg, km_record_writer **out)
{
    if (out)
        *out = NULL;
    if (!cfg || !out || !cfg->path)
        return KM_ERR_NULL_POINTER;
    if (cfg->path[0] == '\0' || cfg->queue_capacity == 0 || cfg->max_queue_bytes == 0 ||
        cfg->max_line_bytes == 0 || cfg->flush_interval_ms == 0 ||
        cfg->max_line_bytes > (UINT64_C(1) << 30))
        return KM_ERR_INVALID_ARGUMENT;

    km_record_writer *w = calloc(1, sizeof *w);
    if (!w)
        return KM_ERR_OUT_OF_MEMORY;
    w->config = *cfg;
    w->fd = -1;
    size_t path_len = strlen(cfg->path);
    w->rotate_name_size = path_len + 16;
    w->path_copy = strdup(cfg->path);
    w->rotate_from = malloc(w->rotate_name_size);
    w->rotate_to = malloc(w->rotate_name_size);
    w->ring = calloc(cfg->queue_capacity, sizeof *w->ring);
    /* one buffer of at least 1 MiB that also holds the longest line and its newline */
    w->buf_cap = (size_t)(cfg->max_line_bytes + 1 > WRITE_BATCH_BYTES ? cfg->max_line_bytes + 1
                                                                       : WRITE_BATCH_BYTES);
    w->buf = malloc(w->buf_cap);
    if (!w->path_copy || !w->rotate_from || !w->rotate_to || !w->ring || !w->buf) {
        writer_free_memory(w);
        return KM_ERR_OUT_OF_MEMORY;
    }
    w->config.path = w->path_copy;

    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_mutex_init(&w->lock, NULL);
    pthread_cond_init(&w->work, &attr);
    pthread_cond_init(&w->done, &attr);
    pthread_condattr_destroy(&attr);
    if (pthread_create(&w->thread, NULL, writer_thread, w) == 0) {
        pthread_setname_np(w->thread, "km-records"); /* for top -H, perf, bench ipc */
    } else {
        writer_free_sync(w);
        writer_free_memory(w);
        return KM_ERR_INTERNAL;
    }
    *out = w;
    return KM_OK;
}

void km_record_writer_destroy(km_record_writer *w)
{
    if (!w)
        return;
    pthread_mutex_lock(&w->lock);
    w->stopping = true;
    pthread_cond_signal(&w->work);
    pthread_mutex_unlock(&w->lock);
    pthread_join(w->thread, NULL);
    for (uint32_t i = 0; i < w->count; i++) /* none: the thread drains before it stops */
        free(w->ring[(w->head + i) % w->config.queue_capacity].data);
    writer_free_sync(w);
    writer_free_memory(w);
}

/* Queue `copy` (malloc'd, len bytes, NULL after a failed allocation; owned from here on). */
static int enqueue(km_record_writer *w, char *copy, size_t len, queued_kind kind)
{
    pthread_mutex_lock(&w->lock);
    int status = KM_OK;
    if (w->stopping)
        status = KM_ERR_SHUTTING_DOWN;
    else if (!copy)
        status = KM_ERR_OUT_OF_MEMORY;
    else if (w->count >= w->config.queue_capacity || w->queued_bytes + len > w->config.max_queue_bytes)
        status = KM_ERR_OVERLOADED;
    if (status == KM_OK) {
        w->ring[(w->head + w->count) % w->config.queue_capacity] = (queued_line){copy, len, kind};
        w->count++;
        w->queued_bytes += len;
        w->submitted++;
        if (w->count == 1)
            pthread_cond_signal(&w->work);
        copy = NULL;
    } else if (status != KM_ERR_SHUTTING_DOWN) {
        w->dropped++;
    }
    pthread_mutex_unlock(&w->lock);
    free(copy);
    return status;
}

int km_record_writer_submit(km_record_writer *w, const char *line, size_t len)
{
    if (!w || !line)
        return KM_ERR_NULL_POINTER;
    if (len == 0 || memchr(line, '\n', len))
        return KM_ERR_INVALID_ARGUMENT;
    if (len > w->config.max_line_bytes)
        return KM_ERR_TOO_LARGE;
    char *copy = malloc(len);
    if (copy)
        memcpy(copy, line, len);
    return enqueue(w, copy, len, QUEUED_LINE);
}

/* ---- deep copies of records (one allocation: the struct, its arrays, then its strings) ------- */


static size_t string_bytes(const char *s) { return s ? km_utf8_clean_copy(NULL, s) : 0; }

static const char *copy_string(char **cursor, const char *s)
{
    if (!s)
        return NULL;
    const char *copy = *cursor;
    *cursor += km_utf8_clean_copy(*cursor, s);
    return copy;
}

static size_t common_string_bytes(const km_record_common *c)
{
    return string_bytes(c->instance) + string_bytes(c->host) + string_bytes(c->kvmatch_version) +
           string_bytes(c->request_id) + string_bytes(c->attempt_id) + string_bytes(c->model) +
           string_bytes(c->pool) + string_bytes(c->endpoint);
}

static void copy_common_strings(km_record_common *c, char **cursor)
{
    c->instance = copy_string(cursor, c->instance);
    c->host = copy_string(cursor, c->host);
    c->kvmatch_version = copy_string(cursor, c->kvmatch_version);
    c->request_id = copy_string(cursor, c->request_id);
    c->attempt_id = copy_string(cursor, c->attempt_id);
    c->model = copy_string(cursor, c->model);
    c->pool = copy_string(cursor, c->pool);
    c->endpoint = copy_string(cursor, c->endpoint);
}

int km_record_writer_submit_decision(km_record_writer *w, const km_decision_record *r)
{
    if (!w || !r)
        return KM_ERR_NULL_POINTER;
    if (r->n_candidates > KM_RECORD_MAX_CANDIDATES)
        return KM_ERR_TOO_LARGE;
    if (r->n_candidates > 0 && !r->candidates)
        return KM_ERR_NULL_POINTER;
    size_t size = sizeof *r + r->n_candidates * sizeof *r->candidates + common_string_bytes(&r->common) +
                  string_bytes(r->owner.worker) + string_bytes(r->owner.state) +
                  string_bytes(r->chosen.worker) + string_bytes(r->chosen.state) +
                  string_bytes(r->policy) + string_bytes(r->reason) + string_bytes(r->load_kind) +
                  string_bytes(r->load_scope) + string_bytes(r->load_stale_instances) +
                  string_bytes(r->warm_up.worker);
    for (size_t i = 0; i < r->n_candidates; i++)
        size += string_bytes(r->candidates[i].worker) + string_bytes(r->candidates[i].state);
    char *block = malloc(size);
    if (block) {
        km_decision_record *copy = (km_decision_record *)(void *)block;
        *copy = *r;
        km_record_candidate *candidates = (km_record_candidate *)(void *)(block + sizeof *r);
        if (r->n_candidates)
            memcpy(candidates, r->candidates, r->n_candidates * sizeof *candidates);
        copy->candidates = r->n_candidates ? candidates : NULL;
        char *cursor = block + sizeof *r + r->n_candidates * sizeof *candidates;
        copy_common_strings(&copy->common, &cursor);
        copy->owner.worker = copy_string(&cursor, r->owner.worker);
        copy->owner.state = copy_string(&cursor, r->owner.state);
        copy->chosen.worker = copy_string(&cursor, r->chosen.worker);
        copy->chosen.state = copy_string(&cursor, r->chosen.state);
        copy->policy = copy_string(&cursor, r->policy);
        copy->reason = copy_string(&cursor, r->reason);
        copy->load_kind = copy_string(&cursor, r->load_kind);
        copy->load_scope = copy_string(&cursor, r->load_scope);
        copy->load_stale_instances = copy_string(&cursor, r->load_stale_instances);
        copy->warm_up.worker = copy_string(&cursor, r->warm_up.worker);
        for (size_t i = 0; i < r->n_candidates; i++) {
            candidates[i].worker = copy_string(&cursor, r->candidates[i].worker);
            candidates[i].state = copy_string(&cursor, r->candidates[i].state);
        }
    }
    return enqueue(w, block, size, QUEUED_DECISION);
}

int km_record_writer_submit_outcome(km_record_writer *w, const km_outcome_record *r)
{
    if (!w || !r)
        return KM_ERR_NULL_POINTER;
    size_t size = sizeof *r + common_string_bytes(&r->common) + string_bytes(r->finish_reason) +
                  string_bytes(r->error) + string_bytes(r->worker) +
                  string_bytes(r->dispatched_worker) + string_bytes(r->owner_worker);
    char *block = malloc(size);
    if (block) {
        km_outcome_record *copy = (km_outcome_record *)(void *)block;
        *copy = *r;
        char *cursor = block + sizeof *r;
        copy_common_strings(&copy->common, &cursor);
        copy->finish_reason = copy_string(&cursor, r->finish_reason);
        copy->error = copy_string(&cursor, r->error);
        copy->worker = copy_string(&cursor, r->worker);
        copy->dispatched_worker = copy_string(&cursor, r->dispatched_worker);
        copy->owner_worker = copy_string(&cursor, r->owner_worker);
    }
    return enqueue(w, block, size, QUEUED_OUTCOME);
}

int km_record_writer_flush(km_record_writer *w, uint32_t timeout_ms)
{
    if (!w)
        return KM_ERR_NULL_POINTER;
    struct timespec deadline;
    int64_t deadline_ns = km_record_clock_ns(CLOCK_MONOTONIC) + (int64_t)timeout_ms * 1000000;
    deadline_to_timespec(deadline_ns, &deadline);
    pthread_mutex_lock(&w->lock);
    uint64_t target = w->submitted;
    if (w->flush_target < target)
        w->flush_target = target;
    if (target == 0 || w->synced_through < target)
        pthread_cond_signal(&w->work);
    int status = KM_OK;
    while (w->synced_through < target) {
        if (timeout_ms == 0)
            pthread_cond_wait(&w->done, &w->lock);
        else if (pthread_cond_timedwait(&w->done, &w->lock, &deadline) == ETIMEDOUT &&
                 w->synced_through < target) {
            status = KM_ERR_TIMEOUT;
            break;
        }
    }
    if (status == KM_OK) {
        if (w->failed > w->failed_at_last_flush || w->sync_failures > w->sync_failures_at_last_flush)
            status = KM_ERR_IO;
        else if (w->invalid > w->invalid_at_last_flush)
            status = KM_ERR_INVALID_ARGUMENT;
        w->failed_at_last_flush = w->failed;
        w->sync_failures_at_last_flush = w->sync_failures;
        w->invalid_at_last_flush = w->invalid;
    }
    pthread_mutex_unlock(&w->lock);
    return status;
}

int km_record_writer_reopen(km_record_writer *w)
{
    if (!w)
        return KM_ERR_NULL_POINTER;
    pthread_mutex_lock(&w->lock);
    w->reopen_requested = true;
    w->reopen_lines = w->count;
    pthread_cond_signal(&w->work);
    pthread_mutex_unlock(&w->lock);
    return KM_OK;
}

void km_record_writer_stats(km_record_writer *w, km_record_writer_counters *out)
{
    if (!out)
        return;
    memset(out, 0, sizeof *out);
    if (!w)
        return;
    pthread_mutex_lock(&w->lock);
    out->submitted = w->submitted;
    out->dropped = w->dropped;
    out->written = w->written;
    out->failed = w->failed;
    out->invalid = w->invalid;
    out->pending = w->submitted - w->written - w->failed - w->invalid;
    out->bytes = w->bytes;
    out->rotations = w->rotations;
    out->deleted_files = w->deleted_files;
    out->deleted_records = w->deleted_records;
    out->deleted_bytes = w->deleted_bytes;
    out->write_errors = w->write_errors;
    out->last_error_status = w->last_error_status;
    out->failing = w->failing_now;
    pthread_mutex_unlock(&w->lock);
}

size_t km_record_writer_last_error(km_record_writer *w, char *buf, size_t size)
{
    if (!w) {
        if (buf && size)
            buf[0] = '\0';
        return 0;
    }
    pthread_mutex_lock(&w->lock);
    size_t n = strlen(w->last_error);
    if (buf && size)
        snprintf(buf, size, "%s", w->last_error);
    pthread_mutex_unlock(&w->lock);
    return n;
}

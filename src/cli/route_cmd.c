/* SPDX-License-Identifier: Apache-2.0 */
/* `kvmatch route`: manual queries against a running `kvmatch serve` (docs/SERVICE.md): one ROUTE
 * from token ids on stdin (or --hashes), a STATUS, a worker list, or adding / removing a worker.
 * Prints the reply as JSON lines. */
#define _POSIX_C_SOURCE 200809L
#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "cli/commands.h"
#include "cli/options.h"
#include "base/array.h"
#include "kvmatch/kvmatch.h"

static void route_usage(FILE *f)
{
    fprintf(f,
            "usage: kvmatch route [--connect ADDR] [--pool P] [--model M] [--request-id ID]\n"
            "                     [--attempt-id A] [--lora NAME] [--salt S] [--policy P]\n"
            "                     [--candidates 0,1,...] [--expected-output N] [--hashes]\n"
            "                     [--warm-ups]\n"
            "                     < decimal token ids (or chain hashes with --hashes:\n"
            "                       decimal or 0x hex)\n"
            "       kvmatch route [--connect ADDR] --status | --workers\n"
            "       kvmatch route [--connect ADDR] --add-worker POOL:ID[=PUB[,REPLAY]]\n"
            "       kvmatch route [--connect ADDR] --remove-worker POOL:ID\n"
            "       kvmatch route [--connect ADDR] --remove-pool POOL\n"
            "       kvmatch route [--connect ADDR] --set-health POOL:ID=healthy|unhealthy\n"
            "       kvmatch route [--connect ADDR] --finish DECISION_ID\n"
            "                     [--outcome complete|incomplete|error|cancelled]\n"
            "  ADDR: unix:/path (default unix:%s) or tcp:127.0.0.1:PORT\n"
            "  Without --request-id each call gets a fresh one (route-<16 hex digits>). A route\n"
            "  starts an attempt the service counts as load until --finish reports its end (or\n"
            "  its active-work TTL expires). --warm-ups: this caller carries out a warm-up the\n"
            "  decision asks for (`warm_up`: send that worker the prompt's first `tokens` tokens,\n"
            "  one output token, and --finish its decision_id). Options take --opt VALUE or\n"
            "  --opt=VALUE.\n"
            "  Exit status: 0 ok, 1 the service refused or could not be reached, 2 usage.\n",
            KM_PROTOCOL_DEFAULT_SOCKET);
}

/* The output speaks the protocol's field names (docs/PROTOCOL.md): a decision, an ACK item, a
 * worker and STATUS_REPLY are printed under the names they travel under, so one name means one
 * thing in the protocol, this command and every client. A failed item prints its `status` code
 * with the code's `name` (as an ERROR message carries it) and `message`. */
static json_t *nullable_string(const char *s)
{
    return s ? json_string(s) : json_null();
}

/* NAN (no value: round_robin's load, an unweighed cost) prints as null, as in the records;
 * json_real would refuse it and drop the key. */
static json_t *nullable_real(double x)
{
    return isfinite(x) ? json_real(x) : json_null();
}

static void set_status(json_t *o, int status, const char *message)
{
    json_object_set_new(o, "status", json_integer(status));
    if (status != KM_OK) {
        json_object_set_new(o, "name", json_string(km_error_name(status)));
        json_object_set_new(o, "message", json_string(message ? message : ""));
    }
}

static json_t *decision_json(const km_route_decision *d)
{
    json_t *o = json_object();
    json_object_set_new(o, "request_id", json_string(d->request_id ? d->request_id : ""));
    json_object_set_new(o, "attempt_id", nullable_string(d->attempt_id));
    set_status(o, d->status, d->message);
    if (d->status != KM_OK)
        return o;
    json_object_set_new(o, "decision_id", json_integer((json_int_t)d->decision_id));
    json_object_set_new(o, "pool", json_string(d->pool ? d->pool : ""));
    json_object_set_new(o, "chosen_worker", json_integer(d->chosen_worker));
    json_object_set_new(o, "chosen_depth", json_integer(d->chosen_depth));
    json_object_set_new(o, "chosen_state", nullable_string(d->chosen_state));
    json_object_set_new(o, "owner_worker", d->has_owner ? json_integer(d->owner_worker) : json_null());
    json_object_set_new(o, "owner_depth", json_integer(d->owner_depth));
    json_object_set_new(o, "owner_state", nullable_string(d->has_owner ? d->owner_state : NULL));
    json_object_set_new(o, "n_blocks", json_integer(d->n_blocks));
    json_object_set_new(o, "block_size", json_integer(d->block_size));
    json_object_set_new(o, "source", json_string(km_prediction_source_name(d->source)));
    json_object_set_new(o, "policy", nullable_string(d->policy));
    json_object_set_new(o, "reason", nullable_string(d->reason));
    json_object_set_new(o, "load_kind", nullable_string(d->load_kind));
    json_object_set_new(o, "load_scope", nullable_string(d->load_scope));
    json_object_set_new(o, "load_value", nullable_real(d->load_value));
    json_t *cands = json_array();
    for (uint32_t i = 0; i < d->n_candidates; i++) {
        const km_candidate_score *c = &d->candidates[i];
        json_t *jc = json_object();
        json_object_set_new(jc, "worker", json_integer(c->worker));
        json_object_set_new(jc, "depth", json_integer(c->depth));
        json_object_set_new(jc, "device_blocks", json_integer(c->device_blocks));
        json_object_set_new(jc, "host_blocks", json_integer(c->host_blocks));
        json_object_set_new(jc, "disk_blocks", json_integer(c->disk_blocks));
        json_object_set_new(jc, "in_flight", json_integer(c->load.in_flight));
        json_object_set_new(jc, "pending_prefill_tokens",
                            json_integer((json_int_t)c->load.pending_prefill_tokens));
        json_object_set_new(jc, "active_decode_blocks",
                            json_integer((json_int_t)c->load.active_decode_blocks));
        json_object_set_new(jc, "cost", nullable_real(c->cost));
        json_object_set_new(jc, "state", nullable_string(c->state));
        json_object_set_new(jc, "eligible", json_boolean(c->eligible));
        json_array_append_new(cands, jc);
    }
    json_object_set_new(o, "candidates", cands);
    json_t *warm = json_null();
    if (d->has_warm_up)
        warm = json_pack("{sI sI sI sI ss}", "worker", (json_int_t)d->warm_up_worker, "blocks",
                         (json_int_t)d->warm_up_blocks, "tokens", (json_int_t)d->warm_up_tokens,
                         "decision_id", (json_int_t)d->warm_up_decision_id, "attempt_id",
                         d->warm_up_attempt_id ? d->warm_up_attempt_id : "");
    json_object_set_new(o, "warm_up", warm ? warm : json_null());
    return o;
}

static json_t *worker_json(const km_worker_info *wi)
{
    json_t *o = json_object();
    json_object_set_new(o, "pool", json_string(wi->pool ? wi->pool : ""));
    json_object_set_new(o, "worker", json_integer(wi->worker));
    json_object_set_new(o, "name", nullable_string(wi->name));
    json_object_set_new(o, "state", nullable_string(wi->state));
    json_object_set_new(o, "blocks", wi->has_blocks ? json_integer((json_int_t)wi->blocks) : json_null());
    json_object_set_new(o, "healthy", wi->has_healthy ? json_boolean(wi->healthy) : json_null());
    json_object_set_new(o, "breaker", nullable_string(wi->breaker));
    json_object_set_new(o, "eligible", wi->has_eligible ? json_boolean(wi->eligible) : json_null());
    return o;
}

static void print_json(json_t *o)
{
    char *s = json_dumps(o, JSON_COMPACT);
    if (s)
        puts(s);
    free(s);
    json_decref(o);
}

/* An integer in 0..max written in `base` (10 or 16), digits only: the whole of s, no sign, no
 * space, no prefix. */
static bool parse_unsigned(const char *s, int base, uint64_t max, uint64_t *out)
{
    size_t digits = strspn(s, base == 16 ? "0123456789abcdefABCDEF" : "0123456789");
    if (digits == 0 || s[digits])
        return false;
    errno = 0;
    unsigned long long x = strtoull(s, NULL, base);
    if (errno || x > max)
        return false;
    *out = x;
    return true;
}

static bool parse_decimal(const char *s, uint64_t max, uint64_t *out)
{
    return parse_unsigned(s, 10, max, out);
}

/* "0,1,5": at most `cap` worker ids. */
static bool parse_candidates(const char *s, uint32_t *ids, uint32_t cap, uint32_t *n)
{
    *n = 0;
    for (;;) {
        size_t len = strcspn(s, ",");
        char word[16];
        uint64_t id;
        if (*n == cap || len == 0 || len >= sizeof word)
            return false;
        memcpy(word, s, len);
        word[len] = 0;
        if (!parse_decimal(word, UINT32_MAX, &id))
            return false;
        ids[(*n)++] = (uint32_t)id;
        if (!s[len])
            return true;
        s += len + 1;
    }
}

/* POOL:ID[=PUB[,REPLAY]] (the endpoints only when `endpoints`), cut in place in spec. */
static bool parse_worker(char *spec, bool endpoints, km_worker_info *w)
{
    char *colon = strchr(spec, ':');
    if (!colon || colon == spec)
        return false;
    *colon = '\0';
    char *id = colon + 1, *eq = strchr(id, '=');
    if (eq) {
        if (!endpoints || !eq[1])
            return false;
        *eq = '\0';
        w->event_endpoint = eq + 1;
        char *comma = strchr(eq + 1, ',');
        if (comma) {
            *comma = '\0';
            w->replay_endpoint = comma + 1;
        }
    }
    uint64_t worker;
    if (!parse_decimal(id, UINT32_MAX, &worker))
        return false;
    w->pool = spec;
    w->worker = (uint32_t)worker;
    return true;
}

/* The next whitespace-separated word of stdin into word (size bytes): 1 read, 0 end of input,
 * -1 a word that does not fit (its first size - 1 bytes in word; the rest of it is consumed). */
static int read_word(char *word, size_t size)
{
    int c;
    while ((c = getchar()) != EOF && isspace(c)) {
    }
    if (c == EOF)
        return 0;
    size_t n = 0;
    bool fits = true;
    for (; c != EOF && !isspace(c); c = getchar()) {
        if (n + 1 < size)
            word[n++] = (char)c;
        else
            fits = false;
    }
    word[n] = '\0';
    return fits ? 1 : -1;
}

/* Read whitespace-separated unsigned integers from stdin: decimal, as `kvmatch hash` reads token
 * ids (a leading 0 is not octal), or with `hex` (chain hashes) also 0x hex. A word longer than 63
 * bytes is refused whole, never read as two numbers. */
static int read_numbers(uint64_t **out, size_t *n_out, uint64_t max, bool hex)
{
    size_t n = 0, cap = 1024;
    uint64_t *v = malloc(cap * sizeof *v);
    if (!v)
        return -1;
    char word[64];
    int got;
    while ((got = read_word(word, sizeof word)) != 0) {
        if (got < 0) {
            fprintf(stderr, "kvmatch route: not a valid number: %s... (a word of more than %zu "
                            "characters)\n", word, sizeof word - 1);
            free(v);
            return -1;
        }
        uint64_t x;
        bool is_hex = hex && word[0] == '0' && (word[1] == 'x' || word[1] == 'X');
        if (!(is_hex ? parse_unsigned(word + 2, 16, max, &x) : parse_decimal(word, max, &x))) {
            fprintf(stderr, "kvmatch route: not a valid number: %s\n", word);
            free(v);
            return -1;
        }
        if (KM_ARRAY_GROW(v, cap, n + 1, 1024)) {
            free(v);
            return -1;
        }
        v[n++] = x;
    }
    *out = v;
    *n_out = n;
    return 0;
}

/* A request id no other call of this command uses: "route-" and 16 random hex digits, so calls
 * without --request-id never collide with an attempt still in flight. */
static void fresh_request_id(char *out, size_t size)
{
    uint64_t r = 0;
    if (getrandom(&r, sizeof r, 0) != (ssize_t)sizeof r) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        r = ((uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec) ^ ((uint64_t)getpid() << 40);
    }
    snprintf(out, size, "route-%016" PRIx64, r);
}

enum {
    OPT_CONNECT = 256, OPT_POOL, OPT_MODEL, OPT_REQUEST_ID, OPT_ATTEMPT_ID, OPT_LORA, OPT_SALT,
    OPT_POLICY, OPT_EXPECTED_OUTPUT, OPT_CANDIDATES, OPT_ADD_WORKER, OPT_REMOVE_WORKER,
    OPT_SET_HEALTH, OPT_REMOVE_POOL, OPT_HASHES, OPT_STATUS, OPT_WORKERS, OPT_FINISH, OPT_OUTCOME,
    OPT_WARM_UPS,
};

int km_cmd_route(int argc, char **argv)
{
    static const struct option options[] = {
        {"help", no_argument, NULL, 'h'},
        {"connect", required_argument, NULL, OPT_CONNECT},
        {"pool", required_argument, NULL, OPT_POOL},
        {"model", required_argument, NULL, OPT_MODEL},
        {"request-id", required_argument, NULL, OPT_REQUEST_ID},
        {"attempt-id", required_argument, NULL, OPT_ATTEMPT_ID},
        {"lora", required_argument, NULL, OPT_LORA},
        {"salt", required_argument, NULL, OPT_SALT},
        {"policy", required_argument, NULL, OPT_POLICY},
        {"expected-output", required_argument, NULL, OPT_EXPECTED_OUTPUT},
        {"candidates", required_argument, NULL, OPT_CANDIDATES},
        {"add-worker", required_argument, NULL, OPT_ADD_WORKER},
        {"remove-worker", required_argument, NULL, OPT_REMOVE_WORKER},
        {"set-health", required_argument, NULL, OPT_SET_HEALTH},
        {"remove-pool", required_argument, NULL, OPT_REMOVE_POOL},
        {"hashes", no_argument, NULL, OPT_HASHES},
        {"warm-ups", no_argument, NULL, OPT_WARM_UPS},
        {"status", no_argument, NULL, OPT_STATUS},
        {"workers", no_argument, NULL, OPT_WORKERS},
        {"finish", required_argument, NULL, OPT_FINISH},
        {"outcome", required_argument, NULL, OPT_OUTCOME},
        {NULL, 0, NULL, 0},
    };
    const char *addr = "unix:" KM_PROTOCOL_DEFAULT_SOCKET;
    km_route_request r;
    memset(&r, 0, sizeof r);
    char request_id[32];
    fresh_request_id(request_id, sizeof request_id);
    r.request_id = request_id;
    bool hashes = false, status = false, list = false, finish = false;
    const char *add = NULL, *remove_w = NULL, *health = NULL, *remove_pool = NULL;
    uint64_t finish_id = 0;
    km_outcome outcome = KM_OUTCOME_COMPLETE;
    bool outcome_given = false;
    const char *route_option = NULL; /* the first option that only a route uses */
    static uint32_t cands[4096]; /* the protocol's default max_candidates */
    km_cli_getopt_begin(argv, "route");
    int opt, index = 0;
    while ((opt = getopt_long(argc, argv, "h", options, &index)) != -1) {
        const char *v = optarg;
        if (!route_option && (opt == OPT_POOL || opt == OPT_MODEL || opt == OPT_REQUEST_ID ||
                              opt == OPT_ATTEMPT_ID || opt == OPT_LORA || opt == OPT_SALT ||
                              opt == OPT_POLICY || opt == OPT_EXPECTED_OUTPUT ||
                              opt == OPT_CANDIDATES || opt == OPT_HASHES || opt == OPT_WARM_UPS))
            route_option = options[index].name;
        switch (opt) {
        case 'h':
            route_usage(stdout);
            return KM_EXIT_OK;
        case OPT_CONNECT: addr = v; break;
        case OPT_POOL: r.pool = v; break;
        case OPT_MODEL: r.model = v; break;
        case OPT_REQUEST_ID: r.request_id = v; break;
        case OPT_ATTEMPT_ID: r.attempt_id = v; break;
        case OPT_LORA: r.lora_name = v; break;
        case OPT_SALT: r.cache_salt = v; break;
        case OPT_POLICY: r.policy = v; break;
        case OPT_HASHES: hashes = true; break;
        case OPT_WARM_UPS: r.warm_ups = true; break;
        case OPT_STATUS: status = true; break;
        case OPT_WORKERS: list = true; break;
        case OPT_ADD_WORKER: add = v; break;
        case OPT_REMOVE_WORKER: remove_w = v; break;
        case OPT_SET_HEALTH: health = v; break;
        case OPT_REMOVE_POOL: remove_pool = v; break;
        case OPT_EXPECTED_OUTPUT:
            r.has_expected_output_tokens = true;
            if (!km_cli_u64("route", "expected-output", v, 0, KM_PROTOCOL_MAX_ROUTE_TOKENS,
                            &r.expected_output_tokens))
                return KM_EXIT_USAGE;
            break;
        case OPT_FINISH:
            finish = true;
            if (!km_cli_u64("route", "finish", v, 1, UINT64_MAX, &finish_id))
                return KM_EXIT_USAGE;
            break;
        case OPT_OUTCOME: {
            outcome_given = true;
            bool known = false;
            for (int k = KM_OUTCOME_COMPLETE; k <= KM_OUTCOME_CANCELLED && !known; k++)
                if (!strcmp(v, km_outcome_name((km_outcome)k))) {
                    outcome = (km_outcome)k;
                    known = true;
                }
            if (!known) {
                fprintf(stderr, "kvmatch route: --outcome is complete, incomplete, error or "
                                "cancelled, got \"%s\"\n", v);
                return KM_EXIT_USAGE;
            }
            break;
        }
        case OPT_CANDIDATES:
            if (!parse_candidates(v, cands, sizeof cands / sizeof cands[0], &r.n_candidates)) {
                fprintf(stderr,
                        "kvmatch route: --candidates wants 1 to %zu worker ids (0,1,...), "
                        "got \"%s\"\n",
                        sizeof cands / sizeof cands[0], v);
                return KM_EXIT_USAGE;
            }
            r.candidates = cands;
            break;
        default:
            return km_cli_usage_error("route");
        }
    }
    if (optind < argc) {
        fprintf(stderr, "kvmatch route: unexpected argument \"%s\" (token ids come on stdin)\n",
                argv[optind]);
        return km_cli_usage_error("route");
    }
    /* Every argument and input word is checked before connecting: a usage error exits 2 whether a
     * server is up or not. */
    if ((status ? 1 : 0) + (list ? 1 : 0) + (add ? 1 : 0) + (remove_w ? 1 : 0) +
            (health ? 1 : 0) + (finish ? 1 : 0) + (remove_pool ? 1 : 0) > 1) {
        fprintf(stderr, "kvmatch route: give one of --status, --workers, --add-worker, "
                        "--remove-worker, --set-health, --finish, --remove-pool\n");
        return KM_EXIT_USAGE;
    }
    if (remove_pool && !*remove_pool) {
        fprintf(stderr, "kvmatch route: --remove-pool wants a pool name\n");
        return KM_EXIT_USAGE;
    }
    /* An option the action does not use would be dropped without a word: refused instead. */
    const char *action = status        ? "--status"
                         : list        ? "--workers"
                         : add         ? "--add-worker"
                         : remove_w    ? "--remove-worker"
                         : health      ? "--set-health"
                         : finish      ? "--finish"
                         : remove_pool ? "--remove-pool"
                                       : NULL;
    if (action && route_option) {
        fprintf(stderr, "kvmatch route: --%s is for a route; %s does not use it\n", route_option,
                action);
        return KM_EXIT_USAGE;
    }
    if (outcome_given && !finish) {
        fprintf(stderr, "kvmatch route: --outcome goes with --finish ID\n");
        return KM_EXIT_USAGE;
    }
    char spec[1024];
    km_worker_info w;
    memset(&w, 0, sizeof w);
    if (add || remove_w) {
        const char *v = add ? add : remove_w;
        bool fits = strlen(v) < sizeof spec;
        if (fits)
            memcpy(spec, v, strlen(v) + 1);
        if (!fits || !parse_worker(spec, add != NULL, &w)) {
            fprintf(stderr, "kvmatch route: %s wants %s, got \"%s\"\n",
                    add ? "--add-worker" : "--remove-worker",
                    add ? "POOL:ID[=PUB[,REPLAY]]" : "POOL:ID", v);
            return KM_EXIT_USAGE;
        }
    }
    if (health) {
        /* POOL:ID=healthy|unhealthy: the router's verdict (WORKERS update). */
        const char *eq = strrchr(health, '=');
        size_t len = eq ? (size_t)(eq - health) : 0;
        bool ok = eq && len < sizeof spec;
        if (ok) {
            memcpy(spec, health, len);
            spec[len] = '\0';
            ok = parse_worker(spec, false, &w) &&
                 (!strcmp(eq + 1, "healthy") || !strcmp(eq + 1, "unhealthy"));
        }
        if (!ok) {
            fprintf(stderr, "kvmatch route: --set-health wants POOL:ID=healthy|unhealthy, got \"%s\"\n",
                    health);
            return KM_EXIT_USAGE;
        }
        w.has_healthy = true;
        w.healthy = !strcmp(eq + 1, "healthy");
    }
    uint64_t *nums = NULL;
    size_t n = 0;
    if (!status && !list && !add && !remove_w && !health && !finish && !remove_pool &&
        read_numbers(&nums, &n, hashes ? UINT64_MAX : UINT32_MAX, hashes) != 0)
        return KM_EXIT_USAGE;
    km_client *c = NULL;
    char why[256];
    int rc = km_client_connect(addr, 5000, &c, why, sizeof why);
    if (rc != KM_OK) {
        fprintf(stderr, "kvmatch route: %s\n", why); /* "KM_ERR_NAME: detail" */
        free(nums);
        return KM_EXIT_FAILURE;
    }
    km_message reply;
    int exit_code = 0;
    if (status) {
        rc = km_client_status(c, 5000, &reply);
        if (rc == KM_OK) {
            json_t *o = json_object();
            json_object_set_new(o, "kvmatch_version", json_string(reply.status_reply.kvmatch_version));
            json_object_set_new(o, "uptime_s", json_real(reply.status_reply.uptime_s));
            json_object_set_new(o, "ready", json_boolean(reply.status_reply.ready));
            json_object_set_new(o, "connections", json_integer(reply.status_reply.connections));
            json_object_set_new(o, "decisions", json_integer((json_int_t)reply.status_reply.decisions));
            json_object_set_new(o, "records_dropped",
                                json_integer((json_int_t)reply.status_reply.records_dropped));
            json_object_set_new(o, "backend", nullable_string(reply.status_reply.backend));
            json_t *workers = json_array();
            for (uint32_t i = 0; i < reply.status_reply.n_workers; i++)
                json_array_append_new(workers, worker_json(&reply.status_reply.workers[i]));
            json_object_set_new(o, "workers", workers);
            print_json(o);
        }
    } else if (finish) {
        /* FINISHED of the attempt a decision started: its active work ends and an outcome record
         * is written. complete needs a finish reason and the stream's end (the outcome rule). */
        km_lifecycle_event e;
        memset(&e, 0, sizeof e);
        e.kind = KM_LIFECYCLE_FINISHED;
        e.has_decision_id = true;
        e.decision_id = finish_id;
        e.outcome = outcome;
        e.finish_reason = outcome == KM_OUTCOME_COMPLETE ? "stop" : NULL;
        e.done_seen = outcome == KM_OUTCOME_COMPLETE;
        e.error = outcome == KM_OUTCOME_ERROR ? "reported with kvmatch route --finish" : NULL;
        rc = km_client_lifecycle(c, &e, 1, 5000, &reply);
        if (rc == KM_OK && reply.type == KM_MESSAGE_ACK)
            for (uint32_t i = 0; i < reply.ack.n_items; i++) {
                json_t *o = json_object();
                json_object_set_new(o, "decision_id", json_integer((json_int_t)finish_id));
                json_object_set_new(o, "status", json_string(km_error_name(reply.ack.items[i].status)));
                if (reply.ack.items[i].message)
                    json_object_set_new(o, "message", json_string(reply.ack.items[i].message));
                exit_code |= reply.ack.items[i].status != KM_OK;
                print_json(o);
            }
    } else if (list || add || remove_w || health || remove_pool) {
        km_message m;
        memset(&m, 0, sizeof m);
        m.type = KM_MESSAGE_WORKERS;
        km_pool_info pool_item;
        memset(&pool_item, 0, sizeof pool_item);
        if (remove_pool) {
            /* POOLS remove: the pool's workers, index, subscriber and snapshot go with it. */
            m.type = KM_MESSAGE_POOLS;
            m.pools.action = KM_ADMIN_REMOVE;
            pool_item.name = remove_pool;
            m.pools.pools = &pool_item;
            m.pools.n_pools = 1;
        } else if (add || remove_w || health) {
            m.workers.action = add ? KM_ADMIN_ADD : remove_w ? KM_ADMIN_REMOVE : KM_ADMIN_UPDATE;
            m.workers.workers = &w;
            m.workers.n_workers = 1;
        } else {
            m.workers.action = KM_ADMIN_LIST;
        }
        rc = km_client_call(c, &m, 5000, &reply);
        if (rc == KM_OK && reply.type == KM_MESSAGE_ACK) {
            for (uint32_t i = 0; i < reply.ack.n_items; i++) {
                json_t *o = json_object();
                set_status(o, reply.ack.items[i].status, reply.ack.items[i].message);
                exit_code |= reply.ack.items[i].status != KM_OK;
                print_json(o);
            }
        } else if (rc == KM_OK && reply.type == KM_MESSAGE_WORKER_LIST) {
            for (uint32_t i = 0; i < reply.workers.n_workers; i++) {
                json_t *o = worker_json(&reply.workers.workers[i]);
                print_json(o);
            }
        }
    } else {
        uint32_t *tokens = NULL;
        if (hashes) {
            r.input = KM_ROUTE_INPUT_HASHES;
            r.hashes = nums;
            r.n_hashes = (uint32_t)n;
        } else {
            tokens = malloc((n ? n : 1) * sizeof *tokens);
            for (size_t i = 0; tokens && i < n; i++)
                tokens[i] = (uint32_t)nums[i];
            r.input = KM_ROUTE_INPUT_TOKENS;
            r.tokens = tokens;
            r.n_tokens = (uint32_t)n;
        }
        rc = km_client_route(c, &r, 1, 5000, &reply);
        if (rc == KM_OK)
            for (uint32_t i = 0; i < reply.decision.n_decisions; i++) {
                exit_code |= reply.decision.decisions[i].status != KM_OK;
                print_json(decision_json(&reply.decision.decisions[i]));
            }
        free(tokens);
    }
    free(nums);
    if (rc != KM_OK) {
        fprintf(stderr, "kvmatch route: %s\n", km_client_last_error(c));
        exit_code = 1;
    }
    km_client_close(c);
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, "kvmatch route: write error\n");
        exit_code = 1;
    }
    return exit_code;
}

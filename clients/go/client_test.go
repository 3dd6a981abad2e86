// SPDX-License-Identifier: Apache-2.0

package kvmatch

// The client against a real `kvmatch serve` ($KM_BIN, else build/kvmatch or build-cpu/kvmatch)
// started on a Unix socket in a temporary directory: routes (blocking, pipelined from many
// goroutines, batched), the lifecycle reports, WORKERS / POOLS / STATUS, each error the server
// answers, servers of their own configured to refuse (ErrOverloaded from the per-connection budget,
// ErrTooLarge for a frame over the server's limit, ErrShuttingDown after a SIGTERM while routes
// are in flight), a server that goes away mid-request and reconnecting once it is back. Replies a real
// server never sends (wrong count, wrong type, unknown id, connection-level ERROR, unreadable or
// oversize frames) come from a fake server written here. Every test is bounded by a context.

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"
)

const testWorkers = 3

func repoRoot(t *testing.T) string {
	dir, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	// Built from a GOPATH link, the working directory is the link's: find the root by its header.
	if _, err := os.Stat(filepath.Join(dir, "include/kvmatch/error.h")); err != nil {
		if root := os.Getenv("KM_ROOT"); root != "" {
			return root
		}
		t.Fatalf("no repository root above %s (set KM_ROOT)", dir)
	}
	return dir
}

func kvmatchBinary(t *testing.T) string {
	candidates := []string{os.Getenv("KM_BIN"), filepath.Join(repoRoot(t), "build/kvmatch"),
		filepath.Join(repoRoot(t), "build-cpu/kvmatch")}
	for _, c := range candidates {
		if c == "" {
			continue
		}
		if st, err := os.Stat(c); err == nil && st.Mode()&0o111 != 0 {
			return c
		}
	}
	t.Fatal("no kvmatch binary: build it with make, or set KM_BIN")
	return ""
}

type server struct {
	t       *testing.T
	dir     string
	address string
	config  map[string]interface{} // config-file keys besides the pool; nil: flags only
	cmd     *exec.Cmd
}

func startServer(t *testing.T) *server {
	return startServerWith(t, nil)
}

// startServerWith starts a server whose config file holds config (docs/SERVICE.md) and the pool.
func startServerWith(t *testing.T, config map[string]interface{}) *server {
	s := &server{t: t, dir: t.TempDir(), config: config}
	s.address = "unix:" + filepath.Join(s.dir, "kvmatch.sock")
	s.start()
	t.Cleanup(s.stop)
	return s
}

func (s *server) start() {
	path := s.address[5:]
	os.Remove(path)
	args := []string{"serve", "--socket", path, "--records", "none", "--max-workers", "64"}
	if s.config != nil {
		workers := []map[string]int{}
		for w := 0; w < testWorkers; w++ {
			workers = append(workers, map[string]int{"id": w})
		}
		config := map[string]interface{}{"pools": []interface{}{map[string]interface{}{
			"name": "default", "block_size": 16, "policy": "kv", "workers": workers}}}
		for k, v := range s.config {
			config[k] = v
		}
		b, err := json.Marshal(config)
		configPath := filepath.Join(s.dir, "kvmatch.json")
		if err == nil {
			err = os.WriteFile(configPath, b, 0o600)
		}
		if err != nil {
			s.t.Fatal(err)
		}
		args = append(args, "--config", configPath)
	} else {
		args = append(args, "--pool", "default:16:kv")
		for w := 0; w < testWorkers; w++ {
			args = append(args, "--worker", fmt.Sprintf("default:%d", w))
		}
	}
	s.cmd = exec.Command(kvmatchBinary(s.t), args...)
	log, _ := os.Create(filepath.Join(s.dir, "serve.log"))
	s.cmd.Stderr = log
	if err := s.cmd.Start(); err != nil {
		s.t.Fatal(err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		c, err := Dial(ctx, s.address)
		cancel()
		if err == nil {
			c.Close()
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	s.t.Fatalf("kvmatch serve did not accept on %s", path)
}

// pause stops the server (SIGSTOP) and returns once every thread of it is stopped.
func (s *server) pause() {
	s.cmd.Process.Signal(syscall.SIGSTOP)
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/stat", s.cmd.Process.Pid))
		stopped := len(tasks) > 0
		for _, task := range tasks {
			b, _ := os.ReadFile(task)
			rest := b[bytes.LastIndexByte(b, ')')+1:]
			if len(rest) < 2 || rest[1] != 'T' {
				stopped = false
			}
		}
		if stopped {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	s.t.Fatal("kvmatch serve did not stop")
}

func (s *server) kill() {
	if s.cmd != nil && s.cmd.ProcessState == nil {
		s.cmd.Process.Kill()
		s.cmd.Wait()
	}
}

func (s *server) stop() {
	if s.cmd != nil && s.cmd.ProcessState == nil {
		s.cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { s.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			s.cmd.Process.Kill()
			<-done
		}
	}
}

func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func dialT(t *testing.T, ctx context.Context, address string) *Client {
	c, err := Dial(ctx, address)
	if err != nil {
		t.Fatalf("dial %s: %v", address, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func prompt(n, seed int) []uint32 {
	p := make([]uint32, n)
	for i := range p {
		p[i] = uint32((seed*7919 + i*31) % 50000)
	}
	return p
}

func u32(v uint32) *uint32   { return &v }
func u64(v uint64) *uint64   { return &v }
func f64(v float64) *float64 { return &v }
func boolp(v bool) *bool     { return &v }

func expectCode(t *testing.T, err error, code Code, what string) {
	t.Helper()
	var ke *Error
	if !errors.Is(err, code) || !errors.As(err, &ke) || ke.Code != code {
		t.Fatalf("%s: expected %s, got %v", what, code.Name(), err)
	}
}

func statuses(items []AckItem) []Code {
	out := make([]Code, len(items))
	for i, it := range items {
		out[i] = it.Status
	}
	return out
}

func TestErrorNamesMatchTheHeader(t *testing.T) {
	header, err := os.ReadFile(filepath.Join(repoRoot(t), "include/kvmatch/error.h"))
	if err != nil {
		t.Fatal(err)
	}
	found := regexp.MustCompile(`X\((KM_\w+), (-?\d+),`).FindAllSubmatch(header, -1)
	if len(found) == 0 || len(found) != len(CodeNames) {
		t.Fatalf("error.h has %d codes, the client %d", len(found), len(CodeNames))
	}
	for _, m := range found {
		code, _ := strconv.Atoi(string(m[2]))
		if Code(code).Name() != string(m[1]) {
			t.Errorf("code %d: client names it %s, error.h %s", code, Code(code).Name(), m[1])
		}
	}
	if Code(-99).Name() != "KM_ERR_UNKNOWN(-99)" {
		t.Errorf("an unknown code: %s", Code(-99).Name())
	}
}

func TestOutcomeRule(t *testing.T) {
	cases := []struct {
		reason        string
		done          bool
		status        uint32
		errSeen, want string
	}{{"stop", true, 200, "", "complete"}, {"stop", false, 200, "", "incomplete"},
		{"", true, 200, "", "incomplete"}, {"stop", true, 503, "", "error"},
		{"stop", true, 200, "reset", "error"}, {"length", true, 0, "", "complete"}}
	for _, c := range cases {
		if got := OutcomeFromStream(c.reason, c.done, c.status, c.errSeen); got != c.want {
			t.Errorf("%+v: got %s", c, got)
		}
	}
}

func TestAddressForms(t *testing.T) {
	ctx := testContext(t)
	for _, bad := range []string{"", "unix:", "tcp:nohost", "http://x", "tcp::80"} {
		_, err := Dial(ctx, bad)
		expectCode(t, err, ErrInvalidArgument, "address "+strconv.Quote(bad))
	}
}

func TestRouteAndLifecycle(t *testing.T) {
	s := startServer(t)
	ctx := testContext(t)
	c := dialT(t, ctx, s.address)
	if c.Welcome().Limits.MaxBatchItems == 0 || c.Welcome().Protocol != 1 {
		t.Fatalf("welcome %+v", c.Welcome())
	}
	tokens := prompt(100, 1)
	ds, err := c.Route(ctx, RouteRequest{RequestID: "r1", AttemptID: "0", Pool: "default",
		Tokens: tokens, ExpectedOutputTokens: u64(50)})
	if err != nil || len(ds) != 1 || ds[0].Err() != nil {
		t.Fatalf("route: %v %+v", err, ds)
	}
	d := ds[0]
	if d.ChosenWorker >= testWorkers || d.NBlocks != 6 || d.BlockSize != 16 || d.Source != "approx" ||
		d.Policy != "kv" || d.LoadScope != "this_instance" || len(d.Candidates) != testWorkers ||
		d.LoadValue == nil || d.OwnerWorker != nil {
		t.Fatalf("decision %+v", d)
	}
	if d.LoadInstances != 0 || d.LoadOldestAgeMs != nil || d.LoadStaleInstances != "" {
		t.Fatalf("this instance's own view carries no cluster fields: %+v", d)
	}
	for _, ev := range []LifecycleEvent{
		{Event: EventDispatched, DecisionID: d.DecisionID, Worker: u32(d.ChosenWorker), ElapsedMs: f64(1)},
		{Event: EventFirstToken, DecisionID: d.DecisionID, ElapsedMs: f64(20)},
		{Event: EventFinished, DecisionID: d.DecisionID, FinishReason: "stop", DoneSeen: true,
			HTTPStatus: 200, CachedTokens: u64(0), ElapsedMs: f64(90)},
	} {
		if err := c.Report(ctx, ev); err != nil {
			t.Fatalf("%s: %v", ev.Event, err)
		}
	}
	again, err := c.Route(ctx, RouteRequest{RequestID: "r2", Tokens: tokens, Brief: true})
	if err != nil || again[0].OwnerWorker == nil || *again[0].OwnerWorker != d.ChosenWorker ||
		again[0].OwnerDepth != 6 || len(again[0].Candidates) != 0 {
		t.Fatalf("the chosen worker learned the prompt: %v %+v", err, again)
	}
	d3, _ := c.Route(ctx, RouteRequest{RequestID: "r3", Tokens: tokens})
	items, err := c.Lifecycle(ctx,
		LifecycleEvent{Event: EventFinished, RequestID: "r1", AttemptID: "0"},
		LifecycleEvent{Event: EventDispatched, DecisionID: 987654321},
		LifecycleEvent{Event: EventFirstToken, DecisionID: d3[0].DecisionID},
		LifecycleEvent{Event: EventFirstToken, DecisionID: d3[0].DecisionID},
		LifecycleEvent{Event: EventFinished, DecisionID: d3[0].DecisionID, Outcome: "complete", FinishReason: "stop"},
		LifecycleEvent{Event: EventFinished, DecisionID: d3[0].DecisionID, ElapsedMs: f64(-1)})
	want := []Code{ErrProtocol, ErrNotFound, OK, ErrProtocol, ErrInvalidArgument, ErrInvalidArgument}
	if err != nil || fmt.Sprint(statuses(items)) != fmt.Sprint(want) {
		t.Fatalf("lifecycle statuses %v, want %v (%v)", statuses(items), want, err)
	}
	if err := items[1].Err(); !errors.Is(err, ErrNotFound) || err.(*Error).Message == "" {
		t.Fatalf("an item's error says why: %v", err)
	}
}

func TestRouteErrors(t *testing.T) {
	s := startServer(t)
	ctx := testContext(t)
	c := dialT(t, ctx, s.address)
	ds, err := c.Route(ctx,
		RouteRequest{RequestID: "ok", Tokens: prompt(40, 0)},
		RouteRequest{RequestID: "nopool", Pool: "nope", Tokens: prompt(40, 0)},
		RouteRequest{RequestID: "nomodel", Model: "no-such-model", Tokens: prompt(40, 0)},
		RouteRequest{RequestID: "badsize", Hashes: []uint64{1, 2}, BlockSize: 32},
		RouteRequest{RequestID: "", Tokens: []uint32{1}},
		RouteRequest{RequestID: "range", Tokens: prompt(20, 0), Candidates: []uint32{63}},
		RouteRequest{RequestID: "empty"})
	if err != nil {
		t.Fatal(err)
	}
	got := make([]Code, len(ds))
	for i := range ds {
		got[i] = ds[i].Status
		if i > 0 && i < 6 && ds[i].Message == "" {
			t.Errorf("route %d failed without a message", i)
		}
	}
	want := []Code{OK, ErrNotFound, ErrNotFound, ErrInvalidArgument, ErrParse, ErrNotFound, OK}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("per-route statuses %v, want %v: %+v", got, want, ds)
	}
	call, err := c.SendMessage(ctx, map[string]interface{}{"type": "NO_SUCH_TYPE"})
	reply, err := do(ctx, call, err)
	expectCode(t, err, ErrProtocol, "an unknown type")
	if reply == nil || reply.Type != "ERROR" {
		t.Fatalf("the ERROR reply is returned: %+v", reply)
	}
	call, err = c.SendMessage(ctx, map[string]interface{}{"type": "ROUTE", "routes": "r"})
	_, err = do(ctx, call, err)
	expectCode(t, err, ErrParse, "routes not an array")
	many := make([]RouteRequest, c.Welcome().Limits.MaxBatchItems+1)
	for i := range many {
		many[i].RequestID = fmt.Sprint("x", i)
	}
	_, err = c.Route(ctx, many...)
	expectCode(t, err, ErrTooLarge, "a batch over max_batch_items")
	call, err = c.SendMessage(ctx, map[string]interface{}{"type": "WORKERS", "action": "explode"})
	_, err = do(ctx, call, err)
	expectCode(t, err, ErrParse, "an unknown WORKERS action")
	if ds, err := c.Route(ctx, RouteRequest{RequestID: "still", Tokens: []uint32{1}}); err != nil || ds[0].Err() != nil {
		t.Fatalf("still serving after the errors: %v", err)
	}
	if items, err := c.UpdateWorkers(ctx, Worker{Pool: "default", Worker: 1, Healthy: boolp(false)}); err != nil || items[0].Err() != nil {
		t.Fatalf("health update: %v %+v", err, items)
	}
	ds, _ = c.Route(ctx, RouteRequest{RequestID: "down", Tokens: []uint32{1}, Candidates: []uint32{1}})
	if !errors.Is(ds[0].Err(), ErrNoHealthyWorker) {
		t.Fatalf("only an unhealthy candidate: %+v", ds[0])
	}
}

func TestAdmin(t *testing.T) {
	s := startServer(t)
	ctx := testContext(t)
	c := dialT(t, ctx, s.address)
	ws, err := c.ListWorkers(ctx, "")
	if err != nil || len(ws) != testWorkers || ws[0].Eligible == nil || ws[0].State == "" {
		t.Fatalf("list: %v %+v", err, ws)
	}
	items, err := c.AddWorkers(ctx, Worker{Pool: "default", Worker: 10, Name: "w10"},
		Worker{Pool: "default", Worker: 1000}, Worker{Pool: "nope", Worker: 11},
		Worker{Pool: "default", Worker: 12, Name: "bad\nname"},
		Worker{Pool: "default", Worker: 13, ReplayEndpoint: "tcp://127.0.0.1:1"})
	want := []Code{OK, ErrWorkerRange, ErrNotFound, ErrInvalidArgument, ErrInvalidArgument}
	if err != nil || fmt.Sprint(statuses(items)) != fmt.Sprint(want) {
		t.Fatalf("add statuses %v, want %v (%v)", statuses(items), want, err)
	}
	if ws, _ := c.ListWorkers(ctx, "default"); len(ws) != testWorkers+1 {
		t.Fatalf("w10 listed: %+v", ws)
	}
	items, _ = c.RemoveWorkers(ctx, Worker{Pool: "default", Worker: 10}, Worker{Pool: "default", Worker: 99})
	if fmt.Sprint(statuses(items)) != fmt.Sprint([]Code{OK, ErrNotFound}) {
		t.Fatalf("remove statuses %v", statuses(items))
	}
	items, _ = c.UpdateWorkers(ctx, Worker{Pool: "default", Worker: 0})
	if items[0].Status != ErrInvalidArgument {
		t.Fatalf("update without healthy: %+v", items)
	}
	items, _ = c.AddPools(ctx, Pool{Name: "second", BlockSize: 32, HashLookaheadTokens: 2, Policy: "least_load"}, Pool{Name: "nosize"})
	if fmt.Sprint(statuses(items)) != fmt.Sprint([]Code{OK, ErrBlockSize}) {
		t.Fatalf("pool add statuses %v", statuses(items))
	}
	pools, err := c.ListPools(ctx)
	if err != nil || len(pools) != 2 || pools[1].Name != "second" || pools[1].BlockSize != 32 || pools[1].HashLookaheadTokens != 2 || len(pools[1].Params) == 0 {
		t.Fatalf("pool list: %v %+v", err, pools)
	}
	st, err := c.Status(ctx)
	if err != nil || st.KvmatchVersion == "" || len(st.Workers) != testWorkers || st.Backend == "" {
		t.Fatalf("status: %v %+v", err, st)
	}
}

func TestRemovePools(t *testing.T) {
	s := startServer(t)
	ctx := testContext(t)
	c := dialT(t, ctx, s.address)
	items, err := c.AddPools(ctx, Pool{Name: "gone", BlockSize: 16, Policy: "kv"})
	if err != nil || items[0].Status != OK {
		t.Fatalf("pool add: %v %+v", err, items)
	}
	items, err = c.AddWorkers(ctx, Worker{Pool: "gone", Worker: 20}, Worker{Pool: "gone", Worker: 21})
	if err != nil || fmt.Sprint(statuses(items)) != fmt.Sprint([]Code{OK, OK}) {
		t.Fatalf("workers of the pool: %v %v", err, statuses(items))
	}
	ds, err := c.Route(ctx, RouteRequest{RequestID: "in-gone", Pool: "gone", Tokens: prompt(64, 0)})
	if err != nil || ds[0].Err() != nil || (ds[0].ChosenWorker != 20 && ds[0].ChosenWorker != 21) {
		t.Fatalf("routed in the pool: %v %+v", err, ds)
	}
	items, err = c.RemovePools(ctx, "gone", "never-was")
	if err != nil || fmt.Sprint(statuses(items)) != fmt.Sprint([]Code{OK, ErrNotFound}) {
		t.Fatalf("pool remove statuses %v (%v)", statuses(items), err)
	}
	pools, _ := c.ListPools(ctx)
	for _, p := range pools {
		if p.Name == "gone" {
			t.Fatalf("the pool is still listed: %+v", pools)
		}
	}
	ws, _ := c.ListWorkers(ctx, "")
	for _, w := range ws {
		if w.Worker == 20 || w.Worker == 21 {
			t.Fatalf("its workers are still listed: %+v", ws)
		}
	}
	ds, err = c.Route(ctx, RouteRequest{RequestID: "after", Pool: "gone", Tokens: prompt(64, 0)})
	if err != nil || ds[0].Status != ErrNotFound {
		t.Fatalf("a route to the removed pool: %v %+v", err, ds)
	}
	// The attempt in flight there ended with its worker: its FINISHED comes late.
	items, err = c.Lifecycle(ctx, LifecycleEvent{Event: EventFinished, RequestID: "in-gone", ElapsedMs: f64(1)})
	if err != nil || items[0].Status != ErrNotFound {
		t.Fatalf("a late FINISHED: %v %+v", err, items)
	}
	if items, err = c.AddPools(ctx, Pool{Name: "gone", BlockSize: 32}); err != nil || items[0].Status != OK {
		t.Fatalf("the name is free again: %v %+v", err, items)
	}
}

// POOLS add names a pool's engine preset (none: the default) and POOL_LIST shows it; an unknown
// preset fails that pool naming the presets, and an update may repeat the pool's preset only.
func TestPoolsNameTheirEngine(t *testing.T) {
	s := startServer(t)
	ctx := testContext(t)
	c := dialT(t, ctx, s.address)
	items, err := c.AddPools(ctx, Pool{Name: "big", BlockSize: 16, Engine: "llama3-70b-h100x4"},
		Pool{Name: "plain", BlockSize: 16}, Pool{Name: "odd", BlockSize: 16, Engine: "h100-9000"})
	if err != nil || fmt.Sprint(statuses(items)) != fmt.Sprint([]Code{OK, OK, ErrInvalidArgument}) {
		t.Fatalf("pool add statuses %v (%v)", statuses(items), err)
	}
	if msg := items[2].Message; !strings.Contains(msg, "h100-9000") ||
		!strings.Contains(msg, "llama3-8b-h100") {
		t.Fatalf("the refusal names the preset asked for and the presets: %q", msg)
	}
	engines := func() map[string]string {
		pools, err := c.ListPools(ctx)
		if err != nil {
			t.Fatalf("pool list: %v", err)
		}
		m := map[string]string{}
		for _, p := range pools {
			m[p.Name] = p.Engine
		}
		return m
	}
	got := engines()
	if _, listed := got["odd"]; listed || got["big"] != "llama3-70b-h100x4" ||
		got["plain"] != "llama3-8b-h100" {
		t.Fatalf("engines listed: %v", got)
	}
	items, err = c.UpdatePools(ctx, Pool{Name: "big", Engine: "llama3-8b-h100"},
		Pool{Name: "plain", Engine: "llama3-70b-h100x4"},
		Pool{Name: "big", Engine: "llama3-70b-h100x4"})
	want := []Code{ErrInvalidArgument, ErrInvalidArgument, OK}
	if err != nil || fmt.Sprint(statuses(items)) != fmt.Sprint(want) {
		t.Fatalf("pool update statuses %v (%v)", statuses(items), err)
	}
	if !strings.Contains(items[0].Message, "llama3-70b-h100x4") {
		t.Fatalf("the refusal names the pool's own preset: %q", items[0].Message)
	}
	if after := engines(); fmt.Sprint(after) != fmt.Sprint(got) {
		t.Fatalf("engines after the refused updates: %v, were %v", after, got)
	}
}

// A frame of 5 routes over a budget of 4 is refused at once, by name, and the connection stays;
// a pipelined burst gets one reply per frame, each a decision or that refusal.
func TestOverloadedByTheConnectionBudget(t *testing.T) {
	s := startServerWith(t, map[string]interface{}{"scheduler": map[string]int{
		"max_connection_routes": 4, "max_queue_wait_ms": 0}})
	ctx := testContext(t)
	c := dialT(t, ctx, s.address)
	routes := make([]RouteRequest, 5)
	for i := range routes {
		routes[i] = RouteRequest{RequestID: fmt.Sprintf("over-%d", i), Tokens: prompt(32, i)}
	}
	_, err := c.Route(ctx, routes...)
	expectCode(t, err, ErrOverloaded, "5 routes over a budget of 4")
	if !regexp.MustCompile(`max_connection_routes`).MatchString(err.Error()) {
		t.Fatalf("the refusal names the limit: %v", err)
	}
	if ds, err := c.Route(ctx, routes[:4]...); err != nil || ds[0].Err() != nil {
		t.Fatalf("4 routes fit the budget: %v", err)
	}
	calls := make([]*Call, 40)
	for i := range calls {
		burst := make([]RouteRequest, 3)
		for j := range burst {
			burst[j] = RouteRequest{RequestID: fmt.Sprintf("burst-%d-%d", i, j), Tokens: prompt(512, i), Brief: true}
		}
		if calls[i], err = c.SendRoute(ctx, burst); err != nil {
			t.Fatalf("send: %v", err)
		}
	}
	decided, refused := 0, 0
	for _, call := range calls {
		reply, err := call.Wait(ctx)
		if err != nil {
			t.Fatalf("a burst frame: %v", err)
		}
		if rerr := reply.Err(); rerr != nil {
			expectCode(t, rerr, ErrOverloaded, "a burst frame")
			refused++
		} else if len(reply.Decisions) != 3 {
			t.Fatalf("one decision per route: %+v", reply)
		} else {
			decided++
		}
	}
	if decided+refused != 40 || decided == 0 {
		t.Fatalf("decided %d, refused %d", decided, refused)
	}
}

// The client refuses a request over the limit WELCOME gave without sending it; a client holding a
// larger limit (an out-of-date view of the server) sends it and reports the server's
// KM_ERR_TOO_LARGE as the connection's end; the server keeps serving other connections.
func TestOversizeFrameIsRefused(t *testing.T) {
	s := startServerWith(t, map[string]interface{}{"limits": map[string]int{"max_frame_bytes": 4096}})
	ctx := testContext(t)
	c := dialT(t, ctx, s.address)
	if c.Welcome().Limits.MaxFrameBytes != 4096 {
		t.Fatalf("welcome limits %+v", c.Welcome().Limits)
	}
	big := RouteRequest{RequestID: "big", Tokens: prompt(3000, 0)}
	_, err := c.Route(ctx, big)
	expectCode(t, err, ErrTooLarge, "the client's own check")
	if ds, err := c.Route(ctx, RouteRequest{RequestID: "small", Tokens: prompt(64, 0)}); err != nil || ds[0].Err() != nil {
		t.Fatalf("a request within the limit: %v", err)
	}
	c.conn().maxFrame = 1 << 20 // the out-of-date view: nothing stops the frame here
	_, err = c.Route(ctx, big)
	expectCode(t, err, ErrClosed, "the server's refusal")
	if !regexp.MustCompile(`KM_ERR_TOO_LARGE`).MatchString(err.Error()) {
		t.Fatalf("the server's code is reported: %v", err)
	}
	other := dialT(t, ctx, s.address)
	if ds, err := other.Route(ctx, RouteRequest{RequestID: "next", Tokens: prompt(64, 0)}); err != nil || ds[0].Err() != nil {
		t.Fatalf("the server keeps serving: %v", err)
	}
}

// SIGTERM while routes are in flight. A connection that never reads its replies (a raw socket
// here) holds the drain open, as the drain writes every reply before it closes a connection, so
// the stop is certain to find work: a route on another open connection during the drain gets
// ErrShuttingDown; every route of a busy client is answered (decided, or refused the same way when
// still unread); once the stalled socket goes the drain ends, both clients end with ErrClosed,
// never a hang, and the server exits 0.
func TestShuttingDownWhileRoutesAreInFlight(t *testing.T) {
	s := startServerWith(t, map[string]interface{}{
		"scheduler":        map[string]int{"max_connection_routes": 0, "max_queue_wait_ms": 0, "max_queued_routes": 1 << 20},
		"drain_timeout_ms": 60000})
	ctx := testContext(t)
	busy := dialT(t, ctx, s.address)
	light := dialT(t, ctx, s.address)
	if ds, err := light.Route(ctx, RouteRequest{RequestID: "before", Tokens: prompt(64, 0)}); err != nil || ds[0].Err() != nil {
		t.Fatalf("decided before the stop: %v", err)
	}
	stalled, err := net.Dial("unix", s.address[5:])
	if err != nil {
		t.Fatal(err)
	}
	defer stalled.Close()
	send := func(kind string, id uint64, kv ...interface{}) {
		payload, err := encodeMessage(kind, id, kv...)
		if err == nil {
			_, err = writeFrame(stalled, payload)
		}
		if err != nil {
			t.Fatalf("stalled connection, %s: %v", kind, err)
		}
	}
	send("HELLO", 1, "protocol", ProtocolVersion, "client", "stalled")
	for i := 0; i < 100; i++ { // about a megabyte of replies, far over what the socket buffers
		frame := make([]interface{}, 64)
		for j := range frame {
			frame[j] = &RouteRequest{RequestID: fmt.Sprintf("s-%d-%d", i, j), Tokens: prompt(64, i*64+j)}
		}
		send("ROUTE", uint64(2+i), "routes", frame)
	}
	calls := make([]*Call, 10)
	for i := range calls {
		frame := make([]RouteRequest, 64)
		for j := range frame {
			frame[j] = RouteRequest{RequestID: fmt.Sprintf("q-%d-%d", i, j), Tokens: prompt(1024, i*64+j), Brief: true}
		}
		if calls[i], err = busy.SendRoute(ctx, frame); err != nil {
			t.Fatalf("send: %v", err)
		}
	}
	s.cmd.Process.Signal(syscall.SIGTERM)
	var refused error
	for n := 0; refused == nil && ctx.Err() == nil; n++ {
		// Read before the stop took effect: decided; try again.
		_, refused = light.Route(ctx, RouteRequest{RequestID: fmt.Sprintf("during-%d", n), Tokens: prompt(64, 0)})
	}
	expectCode(t, refused, ErrShuttingDown, "a route during the drain")
	decided, shut := 0, 0
	for _, call := range calls {
		reply, err := call.Wait(ctx)
		if err != nil {
			t.Fatalf("a queued route: %v", err)
		}
		if rerr := reply.Err(); rerr != nil {
			expectCode(t, rerr, ErrShuttingDown, "a queued route")
			shut++
		} else {
			decided++
		}
	}
	if decided+shut != len(calls) {
		t.Fatalf("decided %d, refused %d of %d", decided, shut, len(calls))
	}
	stalled.Close()
	// The drain ends a few ms after the stalled socket goes: then each connection is closed.
	for _, c := range []*Client{busy, light} {
		err := error(nil)
		for err == nil || errors.Is(err, ErrShuttingDown) {
			if ctx.Err() != nil {
				t.Fatal("the connection was not closed after the drain")
			}
			var ds []Decision
			ds, err = c.Route(ctx, RouteRequest{RequestID: "after", Tokens: []uint32{1}})
			if err == nil {
				t.Fatalf("a route was decided after the stop: %+v", ds)
			}
		}
		expectCode(t, err, ErrClosed, "a route after the drain")
	}
	if err := s.cmd.Wait(); err != nil {
		t.Fatalf("kvmatch serve after the drain: %v", err)
	}
}

func TestPipelinedFromManyGoroutines(t *testing.T) {
	s := startServer(t)
	ctx := testContext(t)
	c := dialT(t, ctx, s.address)
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for g := 0; g < 16; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < 20; i++ {
				routes := make([]RouteRequest, 1+i%4)
				for j := range routes {
					routes[j] = RouteRequest{RequestID: fmt.Sprintf("g%d-%d-%d", g, i, j), Tokens: prompt(16*(j+1), g*100+i)}
				}
				ds, err := c.Route(ctx, routes...)
				if err == nil && len(ds) != len(routes) {
					err = fmt.Errorf("%d decisions for %d routes", len(ds), len(routes))
				}
				for j := 0; err == nil && j < len(ds); j++ {
					if ds[j].RequestID != routes[j].RequestID {
						err = fmt.Errorf("decision %d answers %s, not %s", j, ds[j].RequestID, routes[j].RequestID)
					}
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}(g)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	// Sent first, waited for in reverse order.
	var calls []*Call
	for i := 0; i < 8; i++ {
		call, err := c.SendRoute(ctx, []RouteRequest{{RequestID: fmt.Sprint("p", i), Tokens: []uint32{uint32(i)}}})
		if err != nil {
			t.Fatal(err)
		}
		calls = append(calls, call)
	}
	for i := len(calls) - 1; i >= 0; i-- {
		reply, err := calls[i].Wait(ctx)
		if err != nil || reply.ID != calls[i].ID || reply.Decisions[0].RequestID != fmt.Sprint("p", i) {
			t.Fatalf("call %d: %v %+v", i, err, reply)
		}
	}
	if c.Outstanding() != 0 {
		t.Fatalf("%d still outstanding", c.Outstanding())
	}
}

func TestServerGoesAwayThenReconnect(t *testing.T) {
	s := startServer(t)
	ctx := testContext(t)
	c := dialT(t, ctx, s.address)
	s.pause() // the request is read by no one ...
	call, err := c.SendRoute(ctx, []RouteRequest{{RequestID: "lost", Tokens: prompt(32, 0)}})
	if err != nil {
		t.Fatal(err)
	}
	s.kill() // ... and the server dies with it in flight
	_, err = call.Wait(ctx)
	expectCode(t, err, ErrClosed, "server gone mid-request")
	_, err = c.Route(ctx, RouteRequest{RequestID: "x"})
	expectCode(t, err, ErrClosed, "a call after")
	short, cancel := context.WithTimeout(ctx, time.Second)
	if err := c.Reconnect(short); err == nil {
		t.Fatal("reconnect with no server succeeded")
	}
	cancel()
	s.start()
	if err := c.Reconnect(ctx); err != nil {
		t.Fatal(err)
	}
	if ds, err := c.Route(ctx, RouteRequest{RequestID: "back", Tokens: []uint32{1}}); err != nil || ds[0].Err() != nil {
		t.Fatalf("served again: %v", err)
	}
}

// ---- a fake server, for replies a real one never sends -----------------------------------------

type fakeMode int

const (
	fakeMiscount           fakeMode = iota // one decision fewer than routes
	fakeWrongType                          // a ROUTE answered with STATUS_REPLY
	fakeUnknownID                          // a reply to an id never sent
	fakeConnectionError                    // ERROR id 0
	fakeGarbage                            // a payload that is not msgpack
	fakeDeep                               // nested deeper than the client reads
	fakeOversize                           // a frame over max_frame_bytes
	fakeWelcomeWrongID                     // WELCOME to another id than the HELLO's
	fakeRefuseHello                        // ERROR KM_ERR_INCOMPATIBLE to the HELLO
	fakeSilentOnce                         // the first ROUTE gets no reply, the next ones one each
	fakeWideWorker                         // a chosen_worker of 2^32 + 2, which is no u32
	fakeNegativeDecisionID                 // a decision_id of -5
	fakeWideRowWorker                      // a candidate row whose worker is 2^32 + 2
	fakeWideProtocol                       // a WELCOME whose protocol is 2^32 + 1
	fakeNoChosenWorker                     // a decided decision without chosen_worker
	fakeNilDecisionID                      // a decided decision whose decision_id is nil
	fakeNoSource                           // a decided decision without source
	fakeCutLarge                           // WELCOME max_frame_bytes 1 GiB; a ROUTE's reply declares almost that, 16 bytes come, closed
)

// readFakeRequest reads one frame a client sent to a fake server and decodes its map; false at
// the connection's end or for a frame that is not a map.
func readFakeRequest(nc net.Conn) (map[string]interface{}, bool) {
	var header [4]byte
	if _, err := io.ReadFull(nc, header[:]); err != nil {
		return nil, false
	}
	payload := make([]byte, binary.BigEndian.Uint32(header[:]))
	if _, err := io.ReadFull(nc, payload); err != nil {
		return nil, false
	}
	var m map[string]interface{}
	if msgpack.Unmarshal(payload, &m) != nil {
		return nil, false
	}
	return m, true
}

// A Unix server whose listen queue is full answers connect with EAGAIN: Dial tries again until its
// context ends, says so, and is connected once the server accepts.
func TestDialWaitsWhileTheListenQueueIsFull(t *testing.T) {
	path := filepath.Join(t.TempDir(), "queue.sock")
	lfd, err := syscall.Socket(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Bind(lfd, &syscall.SockaddrUnix{Name: path}); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Listen(lfd, 0); err != nil { // room for one connection not yet accepted
		t.Fatal(err)
	}
	listener, err := net.FileListener(os.NewFile(uintptr(lfd), "queue"))
	syscall.Close(lfd) // FileListener holds a duplicate
	if err != nil {
		t.Fatal(err)
	}
	defer listener.Close()
	filler, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer filler.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	started := time.Now()
	_, err = Dial(ctx, "unix:"+path)
	took := time.Since(started)
	cancel()
	if err == nil || !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "listen queue") {
		t.Fatalf("Dial to a full listen queue: %v", err)
	}
	// It kept trying for its timeout; the upper bound only catches one it ignores.
	if took < 250*time.Millisecond || took > 10*time.Second {
		t.Fatalf("Dial took %v for a 300 ms context", took)
	}

	go func() {
		time.Sleep(200 * time.Millisecond)
		first, err := listener.Accept()
		if err != nil {
			return
		}
		first.Close()
		nc, err := listener.Accept()
		if err != nil {
			return
		}
		defer nc.Close()
		m, ok := readFakeRequest(nc)
		if !ok {
			return
		}
		b, _ := msgpack.Marshal(map[string]interface{}{"type": "WELCOME", "id": m["id"], "protocol": 1,
			"kvmatch_version": "fake", "server": "fake-queue"})
		writeFrame(nc, b)
		io.Copy(io.Discard, nc) // until the client closes
	}()
	c := dialT(t, testContext(t), "unix:"+path)
	c.Close()
}

func fakeServer(t *testing.T, mode fakeMode) string {
	path := filepath.Join(t.TempDir(), "fake.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		nc, err := l.Accept()
		if err != nil {
			return
		}
		defer nc.Close()
		send := func(m map[string]interface{}) {
			b, _ := msgpack.Marshal(m)
			writeFrame(nc, b)
		}
		silent := mode == fakeSilentOnce
		for {
			m, ok := readFakeRequest(nc)
			if !ok {
				return
			}
			id := m["id"]
			switch {
			case m["type"] == "HELLO" && mode == fakeRefuseHello:
				send(map[string]interface{}{"type": "ERROR", "id": id, "code": -14, "name": "KM_ERR_INCOMPATIBLE", "message": "protocol 1 is not spoken here"})
			case m["type"] == "HELLO" && mode == fakeWideProtocol:
				send(map[string]interface{}{"type": "WELCOME", "id": id, "protocol": uint64(1<<32 + 1),
					"kvmatch_version": "fake"})
			case m["type"] == "HELLO" && mode == fakeCutLarge:
				send(map[string]interface{}{"type": "WELCOME", "id": id, "protocol": 1, "kvmatch_version": "fake",
					"limits": map[string]interface{}{"max_frame_bytes": 1 << 30}})
			case m["type"] == "HELLO" && mode == fakeWelcomeWrongID:
				send(map[string]interface{}{"type": "WELCOME", "id": 7, "protocol": 1, "kvmatch_version": "fake"})
			case m["type"] == "HELLO":
				send(map[string]interface{}{"type": "WELCOME", "id": id, "protocol": 1, "kvmatch_version": "fake",
					"limits": map[string]interface{}{"max_frame_bytes": 4096, "max_batch_items": 16}})
			case silent:
				silent = false
			default:
				routes, _ := m["routes"].([]interface{})
				decisions := []interface{}{}
				for range routes {
					row := []interface{}{2, 1, 1, 0, 0, 0, 0, 0, nil, "LIVE", true, "appended"}
					decision := map[string]interface{}{"status": 0, "decision_id": 1,
						"chosen_worker": 2, "source": "events", "candidates": []interface{}{row}}
					switch mode {
					case fakeWideWorker:
						decision["chosen_worker"] = uint64(1<<32 + 2)
					case fakeNegativeDecisionID:
						decision["decision_id"] = -5
					case fakeWideRowWorker:
						row[0] = uint64(1<<32 + 2)
					case fakeNoChosenWorker:
						delete(decision, "chosen_worker")
					case fakeNilDecisionID:
						decision["decision_id"] = nil
					case fakeNoSource:
						delete(decision, "source")
					}
					decisions = append(decisions, decision)
				}
				switch mode {
				case fakeMiscount:
					send(map[string]interface{}{"type": "DECISION", "id": id, "decisions": decisions[1:]})
				case fakeWrongType:
					send(map[string]interface{}{"type": "STATUS_REPLY", "id": id, "kvmatch_version": "fake"})
				case fakeUnknownID:
					send(map[string]interface{}{"type": "DECISION", "id": 4242, "decisions": decisions})
				case fakeConnectionError:
					send(map[string]interface{}{"type": "ERROR", "id": 0, "code": -19, "name": "KM_ERR_TIMEOUT", "message": "idle"})
				case fakeGarbage:
					writeFrame(nc, []byte{0xc1, 0x00})
				case fakeDeep:
					deep := bytes.Repeat([]byte{0x91}, 100)
					writeFrame(nc, append(deep, 0xc0))
				case fakeOversize:
					var h [4]byte
					binary.BigEndian.PutUint32(h[:], 1<<20)
					nc.Write(h[:])
				case fakeCutLarge:
					var h [4]byte
					binary.BigEndian.PutUint32(h[:], 1<<30-1)
					nc.Write(append(h[:], bytes.Repeat([]byte{0x81}, 16)...))
					return
				default:
					send(map[string]interface{}{"type": "DECISION", "id": id, "decisions": decisions})
				}
			}
		}
	}()
	return "unix:" + path
}

func TestRefusedReplies(t *testing.T) {
	ctx := testContext(t)
	for _, tc := range []struct {
		mode fakeMode
		code Code
		name string
	}{{fakeMiscount, ErrProtocol, "one decision fewer"}, {fakeWrongType, ErrProtocol, "wrong type"},
		{fakeUnknownID, ErrProtocol, "unknown id"}, {fakeConnectionError, ErrClosed, "connection-level ERROR"},
		{fakeGarbage, ErrParse, "not msgpack"}, {fakeDeep, ErrParse, "nested too deep"},
		{fakeOversize, ErrTooLarge, "frame over max_frame_bytes"},
		{fakeWideWorker, ErrParse, "a chosen_worker over 32 bits"},
		{fakeNegativeDecisionID, ErrParse, "a negative decision_id"},
		{fakeWideRowWorker, ErrParse, "a candidate row's worker over 32 bits"},
		{fakeNoChosenWorker, ErrParse, "a decided decision without chosen_worker"},
		{fakeNilDecisionID, ErrParse, "a decided decision whose decision_id is nil"},
		{fakeNoSource, ErrParse, "a decided decision without source"}} {
		c := dialT(t, ctx, fakeServer(t, tc.mode))
		_, err := c.Route(ctx, RouteRequest{RequestID: "a"}, RouteRequest{RequestID: "b"})
		expectCode(t, err, tc.code, tc.name)
		if c.Err() == nil {
			t.Fatalf("%s: the connection stays open", tc.name)
		}
		_, err = c.Route(ctx, RouteRequest{RequestID: "c"})
		expectCode(t, err, ErrClosed, tc.name+": a call after")
	}
	_, err := Dial(ctx, fakeServer(t, fakeWelcomeWrongID))
	expectCode(t, err, ErrProtocol, "a WELCOME to another id")
	_, err = Dial(ctx, fakeServer(t, fakeRefuseHello))
	expectCode(t, err, ErrIncompatible, "a refused handshake")
	_, err = Dial(ctx, fakeServer(t, fakeWideProtocol))
	expectCode(t, err, ErrParse, "a WELCOME whose protocol is no u32")
}

// readPayload returns exactly the bytes a payload holds whatever its size against the first
// buffer and its doublings, and fails on one cut short by any amount.
func TestReadPayloadAcrossItsGrowth(t *testing.T) {
	seed := time.Now().UnixNano()
	rng := rand.New(rand.NewSource(seed))
	sizes := []int{1, 100, firstReadBytes - 1, firstReadBytes, firstReadBytes + 1, 3 * firstReadBytes,
		1<<20 + 3}
	for k := 0; k < 8; k++ {
		sizes = append(sizes, 1+rng.Intn(4*firstReadBytes))
	}
	for _, n := range sizes {
		data := make([]byte, n)
		rng.Read(data)
		got, err := readPayload(bytes.NewReader(data), uint32(n))
		if err != nil || !bytes.Equal(got, data) {
			t.Fatalf("a payload of %d bytes (seed %d): %d bytes back, %v", n, seed, len(got), err)
		}
		cut := rng.Intn(n)
		if _, err := readPayload(bytes.NewReader(data[:cut]), uint32(n)); err == nil {
			t.Fatalf("a payload of %d bytes cut to %d (seed %d) was read whole", n, cut, seed)
		}
	}
}

// A reply whose frame declares far more bytes than come costs the client what came, not what was
// declared: the payload grows as it arrives.
func TestAReplyCutShortCostsWhatArrived(t *testing.T) {
	ctx := testContext(t)
	c := dialT(t, ctx, fakeServer(t, fakeCutLarge))
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	_, err := c.Route(ctx, RouteRequest{RequestID: "a"})
	runtime.ReadMemStats(&after)
	expectCode(t, err, ErrClosed, "a frame cut short")
	if grew := after.TotalAlloc - before.TotalAlloc; grew > 64<<20 {
		t.Fatalf("a frame declaring 1 GiB of which 16 bytes came allocated %d bytes", grew)
	}
}

// fakeAnswering is a fake server that answers each request with answer's reply to it, the
// request's id added. A HELLO that answer leaves nil gets a WELCOME; another request closes the
// connection.
func fakeAnswering(t *testing.T, answer func(request fakeMap) fakeMap) string {
	return fakeReplying(t, func(m fakeMap) interface{} {
		reply := answer(m)
		if reply == nil && m["type"] == "HELLO" {
			reply = fakeMap{"type": "WELCOME", "protocol": 1, "kvmatch_version": "fake"}
		}
		if reply == nil {
			return nil
		}
		reply["id"] = m["id"]
		return reply
	})
}

type fakeMap = map[string]interface{}

// fakeWorker is a WORKER_LIST's worker map with key (load.KEY: in its load map) set to v.
func fakeWorker(key string, v interface{}) fakeMap {
	w := fakeMap{"pool": "p", "worker": 1, "state": "LIVE", "blocks": 3, "dp_rank": 0,
		"expected_seq": 9, "failures": 0,
		"load": fakeMap{"in_flight": 1, "pending_prefill_tokens": 2, "active_decode_blocks": 3}}
	if strings.HasPrefix(key, "load.") {
		w["load"].(fakeMap)[strings.TrimPrefix(key, "load.")] = v
	} else {
		w[key] = v
	}
	return w
}

// fakePool is a POOL_LIST's pool map with key set to v.
func fakePool(key string, v interface{}) fakeMap {
	p := fakeMap{"name": "p", "model": "m", "block_size": 16, "hash_lookahead_tokens": 0,
		"offload_chunk_blocks": 1, "policy": "kv_aware"}
	p[key] = v
	return p
}

// fakeStatusReply is a STATUS_REPLY with key set to v.
func fakeStatusReply(key string, v interface{}) fakeMap {
	r := fakeMap{"type": "STATUS_REPLY", "kvmatch_version": "fake", "uptime_s": 1.5,
		"ready": true, "connections": 1, "decisions": 2, "records_dropped": 0, "backend": "cpu",
		"workers": []interface{}{fakeWorker("blocks", 3)}}
	r[key] = v
	return r
}

func fakeAck(status interface{}) fakeMap {
	return fakeMap{"type": "ACK", "items": []interface{}{fakeMap{"status": status}}}
}

// Every integer of a reply is read within its type's range: one outside it (negative, or wider
// than the field) is ErrParse and closes the connection, never a wrapped value that passes for
// another one.
func TestReplyIntegersOutsideTheirType(t *testing.T) {
	ctx := testContext(t)
	wide32, wide64 := uint64(1<<32+4096), uint64(1<<63+5)
	lifecycle := func(c *Client) error {
		_, err := c.Lifecycle(ctx, LifecycleEvent{Event: EventDispatched, DecisionID: 1})
		return err
	}
	addWorkers := func(c *Client) error {
		_, err := c.AddWorkers(ctx, Worker{Pool: "p", Worker: 1})
		return err
	}
	listWorkers := func(c *Client) error { _, err := c.ListWorkers(ctx, ""); return err }
	listPools := func(c *Client) error { _, err := c.ListPools(ctx); return err }
	status := func(c *Client) error { _, err := c.Status(ctx); return err }
	type refused struct {
		name  string
		call  func(*Client) error
		reply fakeMap
	}
	cases := []refused{{"an ACK item's status over 2^63 - 1", lifecycle, fakeAck(wide64)},
		{"a WORKERS add's ACK item status over 2^63 - 1", addWorkers, fakeAck(wide64)}}
	for _, f := range []struct {
		key string
		v   interface{}
	}{{"worker", wide32}, {"dp_rank", wide32}, {"blocks", -1}, {"expected_seq", -1},
		{"failures", wide32}, {"load.in_flight", wide32}, {"load.pending_prefill_tokens", -1},
		{"load.active_decode_blocks", -1}} {
		cases = append(cases, refused{fmt.Sprintf("WORKER_LIST: a worker's %s of %v", f.key, f.v),
			listWorkers, fakeMap{"type": "WORKER_LIST",
				"workers": []interface{}{fakeWorker(f.key, f.v)}}})
	}
	for _, f := range []struct {
		key string
		v   interface{}
	}{{"block_size", wide32}, {"hash_lookahead_tokens", -1}, {"offload_chunk_blocks", wide32}} {
		cases = append(cases, refused{fmt.Sprintf("POOL_LIST: a pool's %s of %v", f.key, f.v),
			listPools, fakeMap{"type": "POOL_LIST", "pools": []interface{}{fakePool(f.key, f.v)}}})
	}
	for _, f := range []struct {
		key string
		v   interface{}
	}{{"connections", wide32}, {"decisions", -1}, {"records_dropped", -1},
		{"workers", []interface{}{fakeWorker("blocks", -1)}}} {
		cases = append(cases, refused{fmt.Sprintf("STATUS_REPLY: %s of %v", f.key, f.v), status,
			fakeStatusReply(f.key, f.v)})
	}
	for _, tc := range cases {
		reply := tc.reply
		c := dialT(t, ctx, fakeAnswering(t, func(m fakeMap) fakeMap {
			if m["type"] == "HELLO" {
				return nil
			}
			return reply
		}))
		expectCode(t, tc.call(c), ErrParse, tc.name)
		if c.Err() == nil {
			t.Fatalf("%s: the connection stays open", tc.name)
		}
		expectCode(t, status(c), ErrClosed, tc.name+": a call after")
	}
	// A WELCOME's limits: a max_frame_bytes of 2^32 + 4096 is no limit of 4096.
	for _, key := range []string{"max_frame_bytes", "max_batch_items", "max_string_bytes"} {
		_, err := Dial(ctx, fakeAnswering(t, func(fakeMap) fakeMap {
			return fakeMap{"type": "WELCOME", "protocol": 1, "kvmatch_version": "fake",
				"limits": fakeMap{"max_frame_bytes": 1 << 20, key: wide32}}
		}))
		expectCode(t, err, ErrParse, "a WELCOME whose limits."+key+" is no u32")
	}
	// The same replies, their integers at the ends of their types' ranges, read as sent.
	c := dialT(t, ctx, fakeAnswering(t, func(m fakeMap) fakeMap {
		switch m["type"] {
		case "HELLO":
			return fakeMap{"type": "WELCOME", "protocol": 1, "kvmatch_version": "fake",
				"limits": fakeMap{"max_frame_bytes": uint32(math.MaxUint32), "max_batch_items": 7}}
		case "LIFECYCLE":
			return fakeAck(int64(math.MinInt64))
		case "POOLS":
			return fakeMap{"type": "POOL_LIST",
				"pools": []interface{}{fakePool("block_size", uint32(math.MaxUint32))}}
		case "WORKERS":
			return fakeMap{"type": "WORKER_LIST",
				"workers": []interface{}{fakeWorker("blocks", uint64(math.MaxUint64))}}
		}
		return fakeStatusReply("connections", uint32(math.MaxUint32))
	}))
	if l := c.Welcome().Limits; l.MaxFrameBytes != math.MaxUint32 || l.MaxBatchItems != 7 {
		t.Fatalf("limits read as %+v", l)
	}
	items, err := c.Lifecycle(ctx, LifecycleEvent{Event: EventDispatched, DecisionID: 1})
	if err != nil || items[0].Status != math.MinInt64 {
		t.Fatalf("an ACK item's status of -2^63: %v %v", items, err)
	}
	pools, err := c.ListPools(ctx)
	if err != nil || pools[0].BlockSize != math.MaxUint32 || pools[0].OffloadChunkBlocks != 1 ||
		pools[0].Policy != "kv_aware" {
		t.Fatalf("a pool's block_size of 2^32 - 1: %+v %v", pools, err)
	}
	workers, err := c.ListWorkers(ctx, "")
	if err != nil || workers[0].Blocks != math.MaxUint64 || *workers[0].DPRank != 0 ||
		*workers[0].ExpectedSeq != 9 || workers[0].Load.ActiveDecodeBlocks != 3 ||
		workers[0].State != "LIVE" {
		t.Fatalf("a worker's blocks of 2^64 - 1: %+v %v", workers, err)
	}
	st, err := c.Status(ctx)
	if err != nil || st.Connections != math.MaxUint32 || st.Decisions != 2 ||
		len(st.Workers) != 1 || st.Workers[0].Blocks != 3 || st.Backend != "cpu" {
		t.Fatalf("a STATUS_REPLY's connections of 2^32 - 1: %+v %v", st, err)
	}
}

func TestDeadlineGivesTheRequestUp(t *testing.T) {
	ctx := testContext(t)
	c := dialT(t, ctx, fakeServer(t, fakeSilentOnce))
	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	_, err := c.Route(short, RouteRequest{RequestID: "slow"})
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("expected the deadline, got %v", err)
	}
	ds, err := c.Route(ctx, RouteRequest{RequestID: "next"})
	if err != nil || len(ds) != 1 || ds[0].Candidates[0].Cost != nil || ds[0].Candidates[0].State != "LIVE" {
		t.Fatalf("the connection stays usable: %v %+v", err, ds)
	}
	big := make([]uint32, 4096)
	_, err = c.Route(ctx, RouteRequest{RequestID: "big", Tokens: big})
	expectCode(t, err, ErrTooLarge, "a request over max_frame_bytes is not sent")
	if c.Err() != nil {
		t.Fatal("refusing to send does not close the connection")
	}
}

// Close from one goroutine while others are routing: every call ends with its decisions or
// ErrClosed, none hangs or panics.
func TestCloseWhileRouting(t *testing.T) {
	s := startServer(t)
	ctx := testContext(t)
	c := dialT(t, ctx, s.address)
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; ; i++ {
				_, err := c.Route(ctx, RouteRequest{RequestID: fmt.Sprintf("c%d-%d", g, i), Tokens: prompt(32, i)})
				if err != nil {
					if !errors.Is(err, ErrClosed) {
						errs <- err
					}
					return
				}
			}
		}(g)
	}
	time.Sleep(100 * time.Millisecond)
	c.Close()
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("a call ended with %v, not ErrClosed", err)
	}
}

// freeTCPAddress is a loopback address nothing listens on (the port was free a moment ago).
func freeTCPAddress(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// holdOnlyConnection dials until the server, at max_connections 1, takes the connection (the
// start-up check's own connection may not be closed on its side yet).
func holdOnlyConnection(t *testing.T, ctx context.Context, address string) *Client {
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := Dial(ctx, address)
		if err == nil {
			t.Cleanup(func() { c.Close() })
			return c
		}
		if time.Now().After(deadline) {
			t.Fatalf("dial %s: %v", address, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A connection the server does not take fails Dial with the server's code, over a Unix socket
// (where the server's close often comes before the HELLO is written) and over TCP.
func TestRefusedConnectionGivesTheServersCode(t *testing.T) {
	tcp := freeTCPAddress(t)
	s := startServerWith(t, map[string]interface{}{"max_connections": 1, "tcp": tcp})
	ctx := testContext(t)
	holdOnlyConnection(t, ctx, s.address)
	for _, address := range []string{s.address, "tcp:" + tcp} {
		for i := 0; i < 20; i++ {
			c, err := Dial(ctx, address)
			if err == nil {
				c.Close()
				t.Fatalf("%s: a second connection was taken at max_connections 1", address)
			}
			expectCode(t, err, ErrOverloaded, address+": a connection over max_connections")
		}
	}
}

// A route blocked in its write (the server reads nothing) ends when its context is cancelled,
// and another caller waiting to write gives up at its own deadline meanwhile.
func TestCancelEndsABlockedWrite(t *testing.T) {
	s := startServer(t)
	ctx := testContext(t)
	c := dialT(t, ctx, s.address)
	s.pause()
	t.Cleanup(func() { s.cmd.Process.Signal(syscall.SIGCONT) })
	// 8 MiB, far over what the socket buffers, in a field that encodes at once.
	huge := RouteRequest{RequestID: "huge", Endpoint: strings.Repeat("x", 8<<20), Tokens: prompt(32, 0)}
	cancellable, cancel := context.WithCancel(context.Background())
	defer cancel()
	blocked := make(chan error, 1)
	go func() {
		_, err := c.Route(cancellable, huge)
		blocked <- err
	}()
	time.Sleep(300 * time.Millisecond) // the frame fills the socket's buffer
	select {
	case err := <-blocked:
		t.Fatalf("the huge route was not blocked: %v", err)
	default:
	}
	start := time.Now()
	short, cancelShort := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancelShort()
	waiting := make(chan error, 1)
	go func() {
		_, err := c.Route(short, RouteRequest{RequestID: "waiting", Tokens: prompt(16, 0)})
		waiting <- err
	}()
	// The server is paused: a caller that waited for the blocked write instead of its deadline
	// would never return. The 20s bounds are far above the 500ms deadline and the cancel.
	select {
	case err := <-waiting:
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("the waiting caller: %v after %v, expected its deadline at 500ms", err, time.Since(start))
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the waiting caller is still waiting for the write 20s after its 500ms deadline")
	}
	cancel()
	select {
	case err := <-blocked:
		if !errors.Is(err, context.Canceled) && !errors.Is(err, ErrTimeout) {
			t.Fatalf("the cancelled route: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the cancelled route is still blocked in its write 20s after the cancel")
	}
}

// A handshake the server never answers ends when Dial's context is cancelled.
func TestCancelEndsAHandshake(t *testing.T) {
	path := filepath.Join(t.TempDir(), "mute.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		if nc, err := l.Accept(); err == nil {
			defer nc.Close()
			io.Copy(io.Discard, nc) // reads the HELLO, answers nothing
		}
	}()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	dialed := make(chan error, 1)
	go func() {
		_, err := Dial(ctx, "unix:"+path)
		dialed <- err
	}()
	time.Sleep(200 * time.Millisecond)
	cancel()
	select {
	case err := <-dialed:
		if err == nil {
			t.Fatal("a handshake nobody answered succeeded")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Dial is still waiting for the WELCOME 5s after its context was cancelled")
	}
}

// A deadline that has passed before the request is written sends nothing: the call fails with
// the deadline and the connection stays usable.
func TestExpiredDeadlineBeforeTheWriteKeepsTheConnection(t *testing.T) {
	s := startServer(t)
	ctx := testContext(t)
	c := dialT(t, ctx, s.address)
	routes := make([]RouteRequest, 16)
	for i := range routes {
		routes[i] = RouteRequest{RequestID: fmt.Sprintf("late-%d", i), Tokens: prompt(4096, i)}
	}
	for i := 0; i < 50; i++ {
		short, cancel := context.WithTimeout(ctx, time.Microsecond)
		_, err := c.Route(short, routes...)
		cancel()
		if err != nil && !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("try %d: %v", i, err)
		}
		if err := c.Err(); err != nil {
			t.Fatalf("try %d closed the connection: %v", i, err)
		}
	}
	if ds, err := c.Route(ctx, RouteRequest{RequestID: "after", Tokens: prompt(32, 0)}); err != nil || ds[0].Err() != nil {
		t.Fatalf("the connection is usable: %v", err)
	}
}

// Goroutines reconnecting at once leave one connection open, the client's, which works.
func TestConcurrentReconnectsShareOneConnection(t *testing.T) {
	s := startServer(t)
	ctx := testContext(t)
	c := dialT(t, ctx, s.address)
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := c.Reconnect(ctx); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("reconnect: %v", err)
	}
	if err := c.Err(); err != nil {
		t.Fatalf("the client's connection is closed: %v", err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		st, err := c.Status(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if st.Connections == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d connections open after the reconnects, expected 1", st.Connections)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// SendMessage counts the routes of a typed slice too: a ROUTE of []map or []RouteRequest with
// one route expects one decision.
func TestSendMessageCountsTypedSlices(t *testing.T) {
	s := startServer(t)
	ctx := testContext(t)
	c := dialT(t, ctx, s.address)
	for _, routes := range []interface{}{
		[]map[string]interface{}{{"request_id": "typed-map", "tokens": prompt(32, 1)}},
		[]RouteRequest{{RequestID: "typed-struct", Tokens: prompt(32, 2)}},
		[1]interface{}{map[string]interface{}{"request_id": "array", "tokens": prompt(32, 3)}},
	} {
		call, err := c.SendMessage(ctx, map[string]interface{}{"type": "ROUTE", "routes": routes})
		if err != nil {
			t.Fatalf("%T: send: %v", routes, err)
		}
		reply, err := call.Wait(ctx)
		if err != nil || reply.Err() != nil || len(reply.Decisions) != 1 || reply.Decisions[0].Err() != nil {
			t.Fatalf("%T: %v %+v", routes, err, reply)
		}
	}
	if err := c.Err(); err != nil {
		t.Fatalf("the connection was closed: %v", err)
	}
}

// A hot prefix on a worker past the ttft policy's load bound (docs/PROTOCOL.md, "Warm-ups"): a
// route whose router carries out warm-ups stays with the holder, and its decision asks for a
// warm-up of another worker with the shared prefix's whole blocks, a decision of its own whose
// DISPATCHED, FIRST_TOKEN and FINISHED by decision id the server acks. A route without WarmUps is
// asked for none.
func TestADecisionAsksForAWarmUp(t *testing.T) {
	s := startServer(t) // testWorkers workers without event endpoints (approx), blocks of 16
	ctx := testContext(t)
	c := dialT(t, ctx, s.address)
	shared := prompt(1024, 5)
	withOwnTail := func(seed int) []uint32 {
		return append(append([]uint32{}, shared...), prompt(16, seed)...)
	}
	for k := 0; k < 6; k++ {
		ds, err := c.Route(ctx, RouteRequest{RequestID: fmt.Sprintf("hot-%d", k),
			Tokens: withOwnTail(100 + k), Candidates: []uint32{0}, Policy: "ttft"})
		if err != nil || ds[0].Err() != nil || ds[0].ChosenWorker != 0 || ds[0].WarmUp != nil {
			t.Fatalf("hot route %d: %v %+v", k, err, ds)
		}
		err = c.Report(ctx, LifecycleEvent{Event: EventFirstToken, DecisionID: ds[0].DecisionID})
		if err != nil {
			t.Fatalf("hot route %d's FIRST_TOKEN: %v", k, err)
		}
	}
	ds, err := c.Route(ctx, RouteRequest{RequestID: "w", AttemptID: "a", Tokens: withOwnTail(99),
		Policy: "ttft", WarmUps: true})
	if err != nil || ds[0].Err() != nil || ds[0].ChosenWorker != 0 {
		t.Fatalf("the route stays with the holder: %v %+v", err, ds)
	}
	d, w := ds[0], ds[0].WarmUp
	if w == nil || w.Worker == 0 || w.Worker >= testWorkers || w.Blocks != 64 || w.Tokens != 1024 ||
		w.AttemptID != "a:warm_up" || w.DecisionID == 0 || w.DecisionID == d.DecisionID {
		t.Fatalf("the decision's warm-up: %+v (decision %d)", w, d.DecisionID)
	}
	items, err := c.Lifecycle(ctx,
		LifecycleEvent{Event: EventDispatched, DecisionID: w.DecisionID, Worker: u32(w.Worker)},
		LifecycleEvent{Event: EventFirstToken, DecisionID: w.DecisionID},
		LifecycleEvent{Event: EventFinished, DecisionID: w.DecisionID, FinishReason: "length",
			DoneSeen: true, HTTPStatus: 200})
	if want := []Code{OK, OK, OK}; err != nil || fmt.Sprint(statuses(items)) != fmt.Sprint(want) {
		t.Fatalf("the warm-up's lifecycle: statuses %v, want %v (%v)", statuses(items), want, err)
	}
	plain, err := c.Route(ctx, RouteRequest{RequestID: "p", Tokens: withOwnTail(98), Policy: "ttft"})
	if err != nil || plain[0].Err() != nil || plain[0].WarmUp != nil {
		t.Fatalf("without WarmUps, no warm-up: %v %+v", err, plain)
	}
}

func natsServerBinary() string {
	if p, err := exec.LookPath("nats-server"); err == nil {
		return p
	}
	for _, p := range []string{"/usr/sbin/nats-server", "/usr/bin/nats-server"} {
		if st, err := os.Stat(p); err == nil && st.Mode()&0o111 != 0 {
			return p
		}
	}
	return ""
}

// startNats starts nats-server on a free loopback port and returns its URL once it accepts.
// Without nats-server the test fails, as the C cluster tests do (scripts/install-deps.sh --test
// installs Debian's nats-server for make test).
func startNats(t *testing.T) string {
	bin := natsServerBinary()
	if bin == "" {
		t.Fatal("nats-server is not installed (scripts/install-deps.sh --test installs Debian's nats-server)")
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	cmd := exec.Command(bin, "-a", "127.0.0.1", "-p", strconv.Itoa(port))
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	address := fmt.Sprintf("127.0.0.1:%d", port)
	deadline := time.Now().Add(5 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", address, time.Second)
		if err == nil {
			c.Close()
			return "nats://" + address
		}
		if time.Now().After(deadline) {
			t.Fatalf("nats-server did not accept on %s", address)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Two instances sharing a real nats-server: a decision on the second says its view is the
// cluster's, with the first instance's contribution applied, fresh and not stale.
func TestDecisionLoadViewOfACluster(t *testing.T) {
	url := startNats(t)
	startServerWith(t, map[string]interface{}{
		"cluster": map[string]string{"url": url, "instance": "client-a"}})
	b := startServerWith(t, map[string]interface{}{
		"cluster": map[string]string{"url": url, "instance": "client-b"}})
	ctx := testContext(t)
	c := dialT(t, ctx, b.address)
	ds, err := c.Route(ctx, RouteRequest{RequestID: "cluster-1", Tokens: prompt(64, 3)})
	if err != nil || len(ds) != 1 || ds[0].Err() != nil {
		t.Fatalf("route: %v %+v", err, ds)
	}
	d := ds[0]
	if d.LoadScope != "cluster" || d.LoadInstances != 1 || d.LoadStaleInstances != "" {
		t.Fatalf("the other instance's work is applied, none stale: %+v", d)
	}
	if d.LoadOldestAgeMs == nil || *d.LoadOldestAgeMs < 0 || *d.LoadOldestAgeMs >= 1000 {
		t.Fatalf("load_oldest_age_ms within the 1000 ms expiry: %v", d.LoadOldestAgeMs)
	}
}

// rawMap encodes as a msgpack map of its keys and values in order, whatever their types and
// repeats: the maps a real server never sends.
type rawMap []interface{}

func (m rawMap) EncodeMsgpack(e *msgpack.Encoder) error {
	if err := e.EncodeMapLen(len(m) / 2); err != nil {
		return err
	}
	for _, v := range m {
		if err := e.Encode(v); err != nil {
			return err
		}
	}
	return nil
}

// fakeReplying is a fake server that answers each request with the value answer gives for it
// (written as msgpack, its id put in by answer); nil closes the connection.
func fakeReplying(t *testing.T, answer func(request fakeMap) interface{}) string {
	path := filepath.Join(t.TempDir(), "fake.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		nc, err := l.Accept()
		if err != nil {
			return
		}
		defer nc.Close()
		for {
			var header [4]byte
			if _, err := io.ReadFull(nc, header[:]); err != nil {
				return
			}
			payload := make([]byte, binary.BigEndian.Uint32(header[:]))
			if _, err := io.ReadFull(nc, payload); err != nil {
				return
			}
			var m fakeMap
			if msgpack.Unmarshal(payload, &m) != nil {
				return
			}
			reply := answer(m)
			if reply == nil {
				return
			}
			b, err := msgpack.Marshal(reply)
			if err != nil {
				return
			}
			writeFrame(nc, b)
		}
	}()
	return "unix:" + path
}

// Map entries whose key is not a str are ignored at every level of a reply, their values
// skipped whole however deeply they nest (docs/PROTOCOL.md): the reply reads as without them.
func TestEntriesWithKeysThatAreNotStrAreIgnored(t *testing.T) {
	ctx := testContext(t)
	// Keys of every other msgpack type, each with a value that nests and holds the field names.
	odd := func() rawMap {
		nested := []interface{}{1, rawMap{"type", "STATUS_REPLY", 5, []interface{}{"id", 9}}}
		return rawMap{7, nested, -3, "x", nil, rawMap{"status", -1}, true, "chosen_worker",
			1.5, []interface{}{"source"}, []byte("type"), "ERROR",
			[]interface{}{"id", []interface{}{2}}, rawMap{"decision_id", 4},
			rawMap{"type", rawMap{"x", 1}}, nested, &msgpack.RawMessage{0xd4, 0x01, 0x02}, 9}
	}
	with := func(fields ...interface{}) rawMap {
		m := odd()[:6]
		m = append(m, fields...)
		return append(m, odd()[6:]...)
	}
	c := dialT(t, ctx, fakeReplying(t, func(m fakeMap) interface{} {
		id := m["id"]
		switch m["type"] {
		case "HELLO":
			return with("type", "WELCOME", "id", id, "protocol", 1, "kvmatch_version", "fake",
				"limits", with("max_frame_bytes", 1<<20, "max_batch_items", 7))
		case "ROUTE":
			row := []interface{}{2, 1, 1, 0, 0, 0, 0, 0, nil, "LIVE", true}
			return with("type", "DECISION", "id", id, "decisions", []interface{}{
				with("status", 0, "decision_id", 11, "chosen_worker", 2, "source", "events",
					"candidates", []interface{}{row}, "warm_up", with("worker", 1, "blocks", 4,
						"tokens", 64, "decision_id", 12, "attempt_id", "a:warm_up"))})
		case "LIFECYCLE":
			return with("type", "ACK", "id", id, "items", []interface{}{with("status", -15)})
		case "WORKERS":
			return with("type", "WORKER_LIST", "id", id, "workers", []interface{}{
				with("pool", "p", "worker", 3, "load", with("in_flight", 4))})
		case "POOLS":
			return with("type", "POOL_LIST", "id", id, "pools", []interface{}{
				with("name", "p", "block_size", 16, "params", fakeMap{"temperature": 0.5})})
		}
		return with("type", "STATUS_REPLY", "id", id, "connections", 6, "workers",
			[]interface{}{with("worker", 8)})
	}))
	if l := c.Welcome().Limits; l.MaxFrameBytes != 1<<20 || l.MaxBatchItems != 7 {
		t.Fatalf("limits read as %+v", l)
	}
	ds, err := c.Route(ctx, RouteRequest{RequestID: "a"})
	if err != nil || ds[0].DecisionID != 11 || ds[0].ChosenWorker != 2 || ds[0].Source != "events" ||
		len(ds[0].Candidates) != 1 || ds[0].Candidates[0].Worker != 2 {
		t.Fatalf("a DECISION: %v %+v", err, ds)
	}
	if w := ds[0].WarmUp; w == nil || *w != (WarmUp{Worker: 1, Blocks: 4, Tokens: 64,
		DecisionID: 12, AttemptID: "a:warm_up"}) {
		t.Fatalf("a DECISION's warm_up: %+v", w)
	}
	items, err := c.Lifecycle(ctx, LifecycleEvent{Event: EventDispatched, DecisionID: 11})
	if err != nil || len(items) != 1 || items[0].Status != ErrNotFound {
		t.Fatalf("an ACK: %v %+v", err, items)
	}
	workers, err := c.ListWorkers(ctx, "")
	if err != nil || len(workers) != 1 || workers[0].Worker != 3 || workers[0].Load == nil ||
		workers[0].Load.InFlight != 4 {
		t.Fatalf("a WORKER_LIST: %v %+v", err, workers)
	}
	pools, err := c.ListPools(ctx)
	if err != nil || len(pools) != 1 || pools[0].BlockSize != 16 ||
		pools[0].Params["temperature"] != 0.5 {
		t.Fatalf("a POOL_LIST: %v %+v", err, pools)
	}
	st, err := c.Status(ctx)
	if err != nil || st.Connections != 6 || len(st.Workers) != 1 || st.Workers[0].Worker != 8 {
		t.Fatalf("a STATUS_REPLY: %v %+v", err, st)
	}
	if err := c.Err(); err != nil {
		t.Fatalf("the connection was closed: %v", err)
	}
}

// A reply's id is a uint64 (docs/PROTOCOL.md): one that is a float (even equal to the id sent), a
// bool, a negative int, a str, an array or a map is ErrProtocol and closes the connection,
// blocking or pipelined, and a WELCOME with such an id fails Dial the same way.
func TestReplyIDThatIsNotARequestID(t *testing.T) {
	ctx := testContext(t)
	toFloat := func(id interface{}) interface{} {
		switch v := id.(type) {
		case int8:
			return float64(v)
		case uint8:
			return float64(v)
		case int64:
			return float64(v)
		case uint64:
			return float64(v)
		}
		return 0.5
	}
	bad := []struct {
		what string
		id   func(id interface{}) interface{}
	}{{"a float", toFloat}, {"a bool", func(interface{}) interface{} { return true }},
		{"a negative", func(interface{}) interface{} { return -2 }},
		{"a str", func(interface{}) interface{} { return "2" }},
		{"an array", func(id interface{}) interface{} { return []interface{}{id} }},
		{"a map", func(id interface{}) interface{} { return fakeMap{"id": id} }}}
	for _, b := range bad {
		for _, pipelined := range []bool{false, true} {
			name := fmt.Sprintf("%s id (pipelined %v)", b.what, pipelined)
			c := dialT(t, ctx, fakeReplying(t, func(m fakeMap) interface{} {
				if m["type"] == "HELLO" {
					return fakeMap{"type": "WELCOME", "id": m["id"], "protocol": 1,
						"kvmatch_version": "fake"}
				}
				return fakeMap{"type": "ERROR", "code": -15, "message": "x", "id": b.id(m["id"])}
			}))
			var err error
			if pipelined {
				call, serr := c.SendRoute(ctx, []RouteRequest{{RequestID: "a"}})
				if serr != nil {
					t.Fatalf("%s: send: %v", name, serr)
				}
				_, err = call.Wait(ctx)
			} else {
				_, err = c.Route(ctx, RouteRequest{RequestID: "a"})
			}
			expectCode(t, err, ErrProtocol, name)
			if c.Err() == nil {
				t.Fatalf("%s: the connection stays open", name)
			}
		}
		_, err := Dial(ctx, fakeReplying(t, func(m fakeMap) interface{} {
			return fakeMap{"type": "WELCOME", "protocol": 1, "kvmatch_version": "fake",
				"id": b.id(m["id"])}
		}))
		expectCode(t, err, ErrProtocol, b.what+" id of a WELCOME")
	}
}

// A read that ends at the connection's deadline is ErrTimeout; the kernel's ETIMEDOUT (a TCP
// peer that stopped answering), whose net.Error says Timeout() too, is a dead connection:
// ErrClosed, and a write it stops is no "nothing sent" timeout that keeps the connection.
func TestKernelTimeoutIsNoDeadline(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	a.SetReadDeadline(time.Now().Add(-time.Second))
	_, deadline := a.Read(make([]byte, 1))
	if !isTimeout(deadline) {
		t.Fatalf("a passed read deadline (%v) is not taken for the deadline", deadline)
	}
	expectCode(t, readError(deadline, false), ErrTimeout, "the read deadline")
	kernel := &net.OpError{Op: "read", Net: "tcp", Err: os.NewSyscallError("read", syscall.ETIMEDOUT)}
	if !kernel.Timeout() {
		t.Fatalf("net.Error does not say Timeout() for ETIMEDOUT here: the test needs another case")
	}
	if isTimeout(kernel) {
		t.Fatalf("the kernel's ETIMEDOUT is taken for the connection's deadline")
	}
	expectCode(t, readError(kernel, false), ErrClosed, "the kernel's ETIMEDOUT")
}

// A key twice in one map of a reply is ErrParse and closes the connection, at every level
// (docs/PROTOCOL.md), a field's name or an unknown one, never the last value silently taken.
func TestKeyTwiceInANestedMap(t *testing.T) {
	ctx := testContext(t)
	listWorkers := func(c *Client) error { _, err := c.ListWorkers(ctx, ""); return err }
	listPools := func(c *Client) error { _, err := c.ListPools(ctx); return err }
	status := func(c *Client) error { _, err := c.Status(ctx); return err }
	lifecycle := func(c *Client) error {
		_, err := c.Lifecycle(ctx, LifecycleEvent{Event: EventDispatched, DecisionID: 1})
		return err
	}
	route := func(c *Client) error {
		_, err := c.Route(ctx, RouteRequest{RequestID: "a"})
		return err
	}
	row := []interface{}{2, 1, 1, 0, 0, 0, 0, 0, nil, "LIVE", true}
	cases := []struct {
		name  string
		call  func(*Client) error
		reply rawMap
	}{
		{"an ACK item's status", lifecycle, rawMap{"type", "ACK", "items",
			[]interface{}{rawMap{"status", 0, "status", -15}}}},
		{"an ACK item's unknown key", lifecycle, rawMap{"type", "ACK", "items",
			[]interface{}{rawMap{"later", 1, "status", 0, "later", 2}}}},
		{"a worker's worker", listWorkers, rawMap{"type", "WORKER_LIST", "workers",
			[]interface{}{rawMap{"pool", "p", "worker", 1, "worker", 2}}}},
		{"a worker's load's in_flight", listWorkers, rawMap{"type", "WORKER_LIST", "workers",
			[]interface{}{rawMap{"pool", "p", "load", rawMap{"in_flight", 1, "in_flight", 2}}}}},
		{"a pool's name", listPools, rawMap{"type", "POOL_LIST", "pools",
			[]interface{}{rawMap{"name", "p", "block_size", 16, "name", "q"}}}},
		{"a pool's parameter", listPools, rawMap{"type", "POOL_LIST", "pools",
			[]interface{}{rawMap{"name", "p", "params", rawMap{"temperature", 0.5,
				"temperature", 2.0}}}}},
		{"a STATUS_REPLY worker's unknown key", status, rawMap{"type", "STATUS_REPLY",
			"kvmatch_version", "fake", "workers",
			[]interface{}{rawMap{"worker", 1, "later", 1, "later", 1}}}},
		{"a decision's unknown key", route, rawMap{"type", "DECISION", "decisions",
			[]interface{}{rawMap{"status", 0, "decision_id", 1, "chosen_worker", 2,
				"source", "events", "later", 1, "later", 2, "candidates",
				[]interface{}{row}}}}},
		{"a decision's warm_up's worker", route, rawMap{"type", "DECISION", "decisions",
			[]interface{}{rawMap{"status", 0, "decision_id", 1, "chosen_worker", 2,
				"source", "events", "warm_up", rawMap{"worker", 1, "blocks", 4, "tokens", 64,
					"decision_id", 3, "attempt_id", "a:warm_up", "worker", 0}}}}},
		{"a decision's warm_up's unknown key", route, rawMap{"type", "DECISION", "decisions",
			[]interface{}{rawMap{"status", 0, "decision_id", 1, "chosen_worker", 2,
				"source", "events", "warm_up", rawMap{"later", 1, "worker", 1, "blocks", 4,
					"tokens", 64, "decision_id", 3, "attempt_id", "a:warm_up", "later", 2}}}}},
		{"a decision's warm_up", route, rawMap{"type", "DECISION", "decisions",
			[]interface{}{rawMap{"status", 0, "decision_id", 1, "chosen_worker", 2,
				"source", "events", "warm_up", fakeMap{"worker": 1, "blocks": 4, "tokens": 64,
					"decision_id": 3, "attempt_id": "a:warm_up"}, "warm_up", nil}}}},
		{"a map in a decision's unknown key", route, rawMap{"type", "DECISION", "decisions",
			[]interface{}{rawMap{"status", 0, "decision_id", 1, "chosen_worker", 2,
				"source", "events", "later", []interface{}{rawMap{"x", 1, "x", 2}}}}}},
		{"a map in a reply's unknown key", status, rawMap{"type", "STATUS_REPLY",
			"kvmatch_version", "fake", "later", rawMap{"y", rawMap{"x", 1, "x", 2}}}},
		{"a map past a candidate row's 11th value", route, rawMap{"type", "DECISION",
			"decisions", []interface{}{rawMap{"status", 0, "decision_id", 1, "chosen_worker", 2,
				"source", "events", "candidates", []interface{}{append(append([]interface{}{},
					row...), rawMap{"x", 1, "x", 2})}}}}},
		{"a map in a worker's unknown key", listWorkers, rawMap{"type", "WORKER_LIST", "workers",
			[]interface{}{rawMap{"pool", "p", "worker", 1, "later", rawMap{"x", 1, "x", 2}}}}},
	}
	for _, tc := range cases {
		reply := tc.reply
		c := dialT(t, ctx, fakeReplying(t, func(m fakeMap) interface{} {
			if m["type"] == "HELLO" {
				return fakeMap{"type": "WELCOME", "id": m["id"], "protocol": 1,
					"kvmatch_version": "fake"}
			}
			return append(rawMap{"id", m["id"]}, reply...)
		}))
		expectCode(t, tc.call(c), ErrParse, tc.name+" twice")
		if c.Err() == nil {
			t.Fatalf("%s twice: the connection stays open", tc.name)
		}
	}
	_, err := Dial(ctx, fakeReplying(t, func(m fakeMap) interface{} {
		return rawMap{"type", "WELCOME", "id", m["id"], "protocol", 1, "kvmatch_version", "fake",
			"limits", rawMap{"max_frame_bytes", 4096, "max_frame_bytes", 1 << 20}}
	}))
	expectCode(t, err, ErrParse, "a WELCOME's limits.max_frame_bytes twice")
}

// RouteRequest sends warm_ups only when WarmUps is set, as true, as it does brief.
func TestWarmUpsIsSentOnlyWhenSet(t *testing.T) {
	for _, set := range []bool{false, true} {
		b, err := msgpack.Marshal(&RouteRequest{RequestID: "a", WarmUps: set})
		var m fakeMap
		if err == nil {
			err = msgpack.Unmarshal(b, &m)
		}
		v, sent := m["warm_ups"]
		if err != nil || sent != set || (set && v != true) {
			t.Fatalf("WarmUps %v: warm_ups %v (sent %v) in %v, %v", set, v, sent, m, err)
		}
	}
}

// A decision's warm_up, when it is not nil, holds worker, blocks, tokens, decision_id and
// attempt_id, each of its field's type and none nil: one that does not is ErrParse, its message
// naming the field, and closes the connection, never a warm-up of worker 0 or decision 0. A
// warm_up of nil, or none, is no warm-up; integers at the ends of their types read as sent.
func TestMalformedWarmUpIsRefused(t *testing.T) {
	ctx := testContext(t)
	warmUp := func(key string, v interface{}) fakeMap {
		w := fakeMap{"worker": 1, "blocks": 64, "tokens": 1024, "decision_id": 7,
			"attempt_id": "a:warm_up"}
		if v == nil {
			delete(w, key)
		} else {
			w[key] = v
		}
		return w
	}
	decidedWith := func(warmUp interface{}) fakeMap {
		d := fakeMap{"status": 0, "decision_id": 6, "chosen_worker": 0, "source": "approx"}
		if warmUp != nil {
			d["warm_up"] = warmUp
		}
		return fakeMap{"type": "DECISION", "decisions": []interface{}{d}}
	}
	nilValued := func(key string) fakeMap {
		w := warmUp("", nil)
		w[key] = nil
		return w
	}
	type refusal struct {
		name, field string // field: what the error names
		warmUp      interface{}
	}
	refused := []refusal{{"not a map", "warm_up", 5}, {"an array", "warm_up", []interface{}{1, 64}},
		{"a worker over 32 bits", "worker", warmUp("worker", uint64(1<<32+1))},
		{"a negative worker", "worker", warmUp("worker", -1)},
		{"blocks over 32 bits", "blocks", warmUp("blocks", uint64(1<<32+64))},
		{"negative tokens", "tokens", warmUp("tokens", -1)},
		{"a float decision_id", "decision_id", warmUp("decision_id", 7.0)},
		{"a str decision_id", "decision_id", warmUp("decision_id", "7")},
		{"an int attempt_id", "attempt_id", warmUp("attempt_id", 3)},
		{"no keys", "worker", fakeMap{}}}
	for _, key := range warmUpKeys {
		refused = append(refused, refusal{"no " + key, key, warmUp(key, nil)},
			refusal{"a nil " + key, key, nilValued(key)})
	}
	for _, tc := range refused {
		reply := decidedWith(tc.warmUp)
		c := dialT(t, ctx, fakeAnswering(t, func(m fakeMap) fakeMap {
			if m["type"] == "HELLO" {
				return nil
			}
			return reply
		}))
		_, err := c.Route(ctx, RouteRequest{RequestID: "a", WarmUps: true})
		expectCode(t, err, ErrParse, "a warm_up with "+tc.name)
		if msg := err.Error(); !strings.Contains(msg, "warm_up") || !strings.Contains(msg, tc.field) {
			t.Fatalf("a warm_up with %s: the error does not name %s: %v", tc.name, tc.field, err)
		}
		if c.Err() == nil {
			t.Fatalf("a warm_up with %s: the connection stays open", tc.name)
		}
	}
	widest := warmUp("worker", uint32(math.MaxUint32))
	widest["blocks"], widest["tokens"] = uint32(math.MaxUint32), uint64(math.MaxUint64)
	widest["decision_id"], widest["later"] = uint64(math.MaxUint64), fakeMap{"x": 1}
	replies := []fakeMap{decidedWith(widest), decidedWith(nil),
		{"type": "DECISION", "decisions": []interface{}{fakeMap{"status": 0, "decision_id": 6,
			"chosen_worker": 0, "source": "approx", "warm_up": nil}}}}
	next := 0
	c := dialT(t, ctx, fakeAnswering(t, func(m fakeMap) fakeMap {
		if m["type"] == "HELLO" {
			return nil
		}
		next++
		return replies[next-1]
	}))
	ds, err := c.Route(ctx, RouteRequest{RequestID: "a", WarmUps: true})
	want := WarmUp{Worker: math.MaxUint32, Blocks: math.MaxUint32, Tokens: math.MaxUint64,
		DecisionID: math.MaxUint64, AttemptID: "a:warm_up"}
	if err != nil || ds[0].WarmUp == nil || *ds[0].WarmUp != want {
		t.Fatalf("a warm_up at the ends of its types: %v %+v", err, ds)
	}
	for _, what := range []string{"no warm_up", "a warm_up of nil"} {
		ds, err := c.Route(ctx, RouteRequest{RequestID: "a", WarmUps: true})
		if err != nil || ds[0].Err() != nil || ds[0].WarmUp != nil {
			t.Fatalf("%s: %v %+v", what, err, ds)
		}
	}
}

// fakeHolding is a fake server that holds its replies to ROUTEs until a route of request id
// "release" arrives, then sends every held reply in order, and the release's last.
func fakeHolding(t *testing.T) string {
	path := filepath.Join(t.TempDir(), "fake.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		nc, err := l.Accept()
		if err != nil {
			return
		}
		defer nc.Close()
		var held [][]byte
		for {
			var header [4]byte
			if _, err := io.ReadFull(nc, header[:]); err != nil {
				return
			}
			payload := make([]byte, binary.BigEndian.Uint32(header[:]))
			if _, err := io.ReadFull(nc, payload); err != nil {
				return
			}
			var m fakeMap
			if msgpack.Unmarshal(payload, &m) != nil {
				return
			}
			if m["type"] == "HELLO" {
				b, _ := msgpack.Marshal(fakeMap{"type": "WELCOME", "id": m["id"], "protocol": 1,
					"kvmatch_version": "fake"})
				writeFrame(nc, b)
				continue
			}
			routes, _ := m["routes"].([]interface{})
			release := false
			decisions := []interface{}{}
			for _, r := range routes {
				route, _ := r.(fakeMap)
				release = release || route["request_id"] == "release"
				decisions = append(decisions, fakeMap{"status": 0, "decision_id": 1,
					"chosen_worker": 2, "source": "events"})
			}
			b, _ := msgpack.Marshal(fakeMap{"type": "DECISION", "id": m["id"],
				"decisions": decisions})
			held = append(held, b)
			if !release {
				continue
			}
			for _, b := range held {
				if _, err := writeFrame(nc, b); err != nil {
					return
				}
			}
			held = held[:0]
		}
	}()
	return "unix:" + path
}

// A call given up by its caller leaves the calls waiting at once, so a server that never answers
// cannot make them grow; the late replies, when they come, are dropped without error and the
// connection goes on.
func TestGivenUpCallsAreForgotten(t *testing.T) {
	ctx := testContext(t)
	c := dialT(t, ctx, fakeHolding(t))
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	_, err := c.Route(short, RouteRequest{RequestID: "slow"})
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("expected the deadline, got %v", err)
	}
	gone, cancelGone := context.WithCancel(ctx)
	cancelGone()
	for i := 0; i < maxAbandoned+10; i++ {
		call, err := c.SendRoute(ctx, []RouteRequest{{RequestID: fmt.Sprintf("r%d", i)}})
		if _, err := do(gone, call, err); !errors.Is(err, context.Canceled) {
			t.Fatalf("call %d: expected it given up, got %v", i, err)
		}
	}
	cn := c.conn()
	cn.mu.Lock()
	waiting, kept := len(cn.calls), len(cn.abandoned)
	cn.mu.Unlock()
	if waiting != 0 || c.Outstanding() != 0 {
		t.Fatalf("%d calls given up are still waiting (Outstanding %d)", waiting, c.Outstanding())
	}
	if kept > maxAbandoned {
		t.Fatalf("%d ids of given-up calls kept, more than %d", kept, maxAbandoned)
	}
	ds, err := c.Route(ctx, RouteRequest{RequestID: "release"})
	if err != nil || len(ds) != 1 || ds[0].ChosenWorker != 2 {
		t.Fatalf("the route after the late replies: %v %+v", err, ds)
	}
	if err := c.Err(); err != nil {
		t.Fatalf("a late reply closed the connection: %v", err)
	}
}

// An ERROR's code is negative (docs/PROTOCOL.md): one of 0 or above is ErrProtocol, as in the
// Python and Rust clients, never a code that names no failure; the reply had its request's id,
// so the connection stays open. A handshake refused so fails Dial with ErrProtocol too.
func TestErrorWhoseCodeIsNotNegative(t *testing.T) {
	ctx := testContext(t)
	for _, code := range []interface{}{nil, 0, 5} {
		c := dialT(t, ctx, fakeAnswering(t, func(m fakeMap) fakeMap {
			if m["type"] == "HELLO" {
				return nil
			}
			return fakeMap{"type": "ERROR", "code": code, "message": "fake"}
		}))
		_, err := c.Status(ctx)
		expectCode(t, err, ErrProtocol, fmt.Sprintf("an ERROR of code %v", code))
		if c.Err() != nil {
			t.Fatalf("an ERROR of code %v closed the connection: %v", code, c.Err())
		}
		_, err = Dial(ctx, fakeAnswering(t, func(m fakeMap) fakeMap {
			return fakeMap{"type": "ERROR", "code": code, "message": "fake"}
		}))
		expectCode(t, err, ErrProtocol, fmt.Sprintf("a handshake refused with code %v", code))
	}
}

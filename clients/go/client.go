// SPDX-License-Identifier: Apache-2.0

// Package kvmatch is a client of `kvmatch serve` (docs/PROTOCOL.md), the placement index and
// decision engine a router asks which engine replica should serve a request.
//
// A Client is one connection, safe for concurrent use: many goroutines may call it at once and
// their requests are pipelined on the connection, each reply matched to its request by id. Every
// call takes a context.Context; its deadline or cancellation ends the call, waiting for the
// connection's writer and writing included, and the call gives its request up: it no longer
// waits on the connection, and the reply, when it comes, is dropped (checked as any reply is
// while at most 4096 given-up calls await theirs; the lowest ids past that are forgotten). A
// request none of which was written when ctx ended is not sent and the connection stays usable;
// one cut off mid-frame closes the connection (ErrTimeout).
//
// Errors are values. A reply of type ERROR, a decision or ACK item that failed, and the client's
// own refusals are *Error, whose Code (a km_status code, itself an error) errors.Is can test:
// errors.Is(err, kvmatch.ErrNotFound). A reply that cannot be read (any integer of it outside
// its field's type's range included, and a decided decision without decision_id, chosen_worker
// or source), is not of its request's type
// (docs/PROTOCOL.md, "Reading replies"), holds another count of decisions or items than its
// request had routes, events, workers or pools, or answers an id that is not waiting or is no
// uint64 (a float, even one equal to an id sent, a negative) closes the connection (ErrParse,
// ErrProtocol, ErrTooLarge); so does a connection-level ERROR (id 0) and a
// server that goes away (ErrClosed). Every call in flight then fails with that error, later calls
// fail with ErrClosed, and Reconnect dials the same address again.
package kvmatch

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"reflect"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/vmihailenco/msgpack/v5"
)

const (
	// ProtocolVersion is the protocol this client speaks.
	ProtocolVersion = 1
	// DefaultAddress is where `kvmatch serve` listens unless told otherwise.
	DefaultAddress = "unix:/tmp/kvmatch.sock"
	// ClientName is sent in HELLO, for the server's logs.
	ClientName = "kvmatch-go"

	defaultMaxFrameBytes = 16 << 20
)

// Client is a connection to kvmatch serve. Create it with Dial.
type Client struct {
	address string
	redial  chan struct{} // one slot: held by the Reconnect that is dialing
	mu      sync.Mutex
	cur     *conn
}

// conn is one connection: the socket, its reader goroutine and the calls waiting on it.
type conn struct {
	nc       net.Conn
	welcome  Welcome
	maxFrame uint32
	// One slot, held by the goroutine writing a frame; a waiter selects it against its ctx.
	writeSlot chan struct{}

	mu     sync.Mutex // guards the fields below
	nextID uint64
	calls  map[uint64]*Call // sent, waited for, not answered yet
	// Given up by their blocking call: the id and what its reply must be, so that a late reply is
	// checked and dropped. At most maxAbandoned; past that the lowest ids are forgotten, and a
	// reply to an id at or below forgotten that is not waiting is dropped unchecked.
	abandoned map[uint64]expected
	forgotten uint64
	err       error // the final error, once the connection is closed
}

// maxAbandoned bounds the ids of given-up calls kept, so that a server that never answers
// cannot make the client's memory grow with every call that times out.
const maxAbandoned = 4096

// expected is what the reply to a request must be besides an ERROR.
type expected struct {
	request string // the request's type
	reply   string // the reply type; "" for a request no server answers (only ERROR fits)
	counted bool   // the reply holds one decision / item per item of the request
	count   int
}

// Call is a request in flight. Wait gives its reply.
type Call struct {
	ID     uint64
	c      *conn
	expect expected
	done   chan struct{}
	reply  *Reply
	err    error
}

// Dial connects to "unix:/path" or "tcp:host:port" ("tcp:[::1]:7070" for IPv6) and does the
// HELLO / WELCOME handshake within ctx. It fails with ErrInvalidArgument for an address of
// another form, ErrIncompatible when the server does not speak ProtocolVersion, the server's code
// when it refuses the handshake or the connection (ErrOverloaded at its max_connections,
// ErrShuttingDown while it drains; read even when the server closed before the HELLO was
// written), ErrProtocol / ErrParse for a reply that is not a WELCOME to the HELLO, or the dial's
// own error. A Unix server whose listen queue is full is waited on, as a blocking connect waits,
// until ctx ends.
func Dial(ctx context.Context, address string) (*Client, error) {
	cn, err := dial(ctx, address)
	if err != nil {
		return nil, err
	}
	return &Client{address: address, redial: make(chan struct{}, 1), cur: cn}, nil
}

func dial(ctx context.Context, address string) (*conn, error) {
	network, target, err := parseAddress(address)
	if err != nil {
		return nil, err
	}
	var d net.Dialer
	nc, err := d.DialContext(ctx, network, target)
	// A Unix socket's connect answers EAGAIN at once while the server's listen queue is full,
	// where a blocking connect would wait for room: it is tried again every 10 ms until ctx ends.
	for err != nil && network == "unix" && errors.Is(err, syscall.EAGAIN) {
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("kvmatch: connect to %s: the server's listen queue stayed full: %w",
				address, ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
		nc, err = d.DialContext(ctx, network, target)
	}
	if err != nil {
		return nil, fmt.Errorf("kvmatch: connect to %s: %w", address, err)
	}
	cn := &conn{nc: nc, maxFrame: defaultMaxFrameBytes, writeSlot: make(chan struct{}, 1), nextID: 1,
		calls: map[uint64]*Call{}, abandoned: map[uint64]expected{}}
	if err := cn.handshake(ctx); err != nil {
		nc.Close()
		return nil, err
	}
	go cn.readLoop()
	return cn, nil
}

func parseAddress(address string) (network, target string, err error) {
	switch {
	case strings.HasPrefix(address, "unix:"):
		if len(address) == 5 {
			return "", "", newError(ErrInvalidArgument, "empty unix socket path")
		}
		return "unix", address[5:], nil
	case strings.HasPrefix(address, "tcp:"):
		host, port, err := net.SplitHostPort(address[4:])
		if err != nil || host == "" || port == "" {
			return "", "", newError(ErrInvalidArgument, "expected tcp:host:port, got %q", address)
		}
		return "tcp", net.JoinHostPort(host, port), nil
	}
	return "", "", newError(ErrInvalidArgument, "address must start with unix: or tcp:, got %q", address)
}

// handshake sends HELLO and reads the WELCOME within ctx: its deadline, and its cancellation,
// which ends a blocked write or read at once.
func (cn *conn) handshake(ctx context.Context) error {
	deadline, _ := ctx.Deadline()
	cn.nc.SetDeadline(deadline)
	defer cn.nc.SetDeadline(time.Time{})
	stop := onDone(ctx, func() { cn.nc.SetDeadline(time.Now()) })
	defer stop()
	payload, err := encodeMessage("HELLO", 1, "protocol", ProtocolVersion, "client", ClientName)
	if err != nil {
		return err
	}
	// A server that refuses the connection (max_connections, shutting down) writes an ERROR
	// saying why and closes, maybe before the HELLO is written: the ERROR is still read.
	if _, werr := writeFrame(cn.nc, payload); werr != nil {
		reply, err := cn.readReply()
		if err != nil || reply.Type != "ERROR" {
			if isTimeout(werr) {
				return newError(ErrTimeout, "the HELLO was not sent before the deadline")
			}
			return newError(ErrClosed, "the HELLO could not be sent: %v", werr)
		}
		return handshakeRefused(reply)
	}
	reply, err := cn.readReply()
	if err != nil {
		return err
	}
	switch {
	case reply.Type == "ERROR":
		return handshakeRefused(reply)
	case reply.Type != "WELCOME":
		return newError(ErrProtocol, "expected WELCOME, got %q", reply.Type)
	case reply.ID != 1:
		return newError(ErrProtocol, "the WELCOME answers request %d, not the HELLO (1)", reply.ID)
	case reply.Protocol != ProtocolVersion:
		return newError(ErrIncompatible, "the server speaks protocol %d", reply.Protocol)
	}
	cn.welcome = Welcome{Protocol: reply.Protocol, KvmatchVersion: reply.KvmatchVersion,
		Server: reply.Server, Limits: reply.Limits}
	if reply.Limits.MaxFrameBytes != 0 {
		cn.maxFrame = reply.Limits.MaxFrameBytes
	}
	cn.nextID = 2
	return nil
}

// handshakeRefused is an ERROR answering the HELLO, or sent with id 0 by a server that does not
// take the connection, as its *Error.
func handshakeRefused(reply *Reply) error {
	code := reply.Code
	if code >= OK {
		code = ErrProtocol
	}
	return newError(code, "the server refused the handshake: %s", serverWords(code, reply.Message))
}

// onDone runs f once if ctx ends before stop is called; stop returns once f has run or never
// will, so f cannot act on what the caller does after stop.
func onDone(ctx context.Context, f func()) (stop func()) {
	done := ctx.Done()
	if done == nil {
		return func() {}
	}
	quit, finished := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(finished)
		select {
		case <-done:
			f()
		case <-quit:
		}
	}()
	return func() {
		close(quit)
		<-finished
	}
}

// isTimeout tells the connection's own deadline (os.ErrDeadlineExceeded, which a context's end
// sets too) from every other error. net.Error's Timeout() is no test of it: it is also true for
// the kernel's ETIMEDOUT, a TCP connection whose peer stopped answering, which is a dead
// connection, failed as any other socket error.
func isTimeout(err error) bool {
	return errors.Is(err, os.ErrDeadlineExceeded)
}

// Welcome is the server's WELCOME on the current connection: its version and limits.
func (c *Client) Welcome() Welcome { return c.conn().welcome }

// Address is the address the client dials.
func (c *Client) Address() string { return c.address }

func (c *Client) conn() *conn {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.cur
}

// Close closes the connection; calls in flight fail with ErrClosed. Closing twice is harmless.
func (c *Client) Close() error {
	c.conn().fail(newError(ErrClosed, "the connection is closed"))
	return nil
}

// Reconnect closes the current connection (calls in flight on it fail with ErrClosed; they are
// not resent: a router decides again) and dials the same address with a new handshake. On
// failure the client stays closed and Reconnect may be called again. Reconnects are made one at
// a time: a call that finds the connection it was called on already replaced by an open one
// keeps that one, so goroutines that enter Reconnect while another is reconnecting after the
// same failure share its new connection (one that enters after that reconnects again).
func (c *Client) Reconnect(ctx context.Context) error {
	called := c.conn()
	select {
	case c.redial <- struct{}{}:
	case <-ctx.Done():
		return fmt.Errorf("kvmatch: reconnect: %w", ctx.Err())
	}
	defer func() { <-c.redial }()
	if cur := c.conn(); cur != called && cur.finalErr() == nil {
		return nil
	}
	c.Close()
	cn, err := dial(ctx, c.address)
	if err != nil {
		return err
	}
	c.mu.Lock()
	c.cur = cn
	c.mu.Unlock()
	return nil
}

// Err is nil while the connection is open, else the error that closed it.
func (c *Client) Err() error {
	cn := c.conn()
	cn.mu.Lock()
	defer cn.mu.Unlock()
	return cn.err
}

// Outstanding counts the requests sent whose reply has not arrived and that someone may still
// wait for (not given up by a blocking call, which forgets them).
func (c *Client) Outstanding() int {
	cn := c.conn()
	cn.mu.Lock()
	defer cn.mu.Unlock()
	return len(cn.calls)
}

// ---- pipelined ----------------------------------------------------------------------------------

// SendRoute sends a ROUTE at once and returns its Call; Wait gives the DECISION.
func (c *Client) SendRoute(ctx context.Context, routes []RouteRequest) (*Call, error) {
	list := make([]interface{}, len(routes))
	for i := range routes {
		list[i] = &routes[i]
	}
	return c.conn().send(ctx, expected{"ROUTE", "DECISION", true, len(routes)}, "routes", list)
}

// SendLifecycle sends a LIFECYCLE at once and returns its Call; Wait gives the ACK.
func (c *Client) SendLifecycle(ctx context.Context, events []LifecycleEvent) (*Call, error) {
	list := make([]interface{}, len(events))
	for i := range events {
		list[i] = &events[i]
	}
	return c.conn().send(ctx, expected{"LIFECYCLE", "ACK", true, len(events)}, "events", list)
}

// SendMessage sends any request written as a map of wire fields with its "type" (the id is
// assigned here; HELLO is Dial's). For requests this package has no method for, and for testing
// a server. The reply must hold one decision or item per element of the request's list
// ("routes", "events", "workers", "pools"), a slice or array of any element type.
func (c *Client) SendMessage(ctx context.Context, message map[string]interface{}) (*Call, error) {
	kind, _ := message["type"].(string)
	if kind == "HELLO" {
		return nil, newError(ErrInvalidArgument, "HELLO is sent by Dial")
	}
	exp := expected{request: kind}
	count := func(key string) int {
		if v := reflect.ValueOf(message[key]); v.Kind() == reflect.Slice || v.Kind() == reflect.Array {
			return v.Len()
		}
		return 0
	}
	switch kind {
	case "ROUTE":
		exp.reply, exp.counted, exp.count = "DECISION", true, count("routes")
	case "LIFECYCLE":
		exp.reply, exp.counted, exp.count = "ACK", true, count("events")
	case EventDispatched, EventFirstToken, EventFinished:
		exp.reply, exp.counted, exp.count = "ACK", true, 1
	case "WORKERS", "POOLS":
		if message["action"] == "list" {
			exp.reply = map[string]string{"WORKERS": "WORKER_LIST", "POOLS": "POOL_LIST"}[kind]
		} else {
			exp.reply, exp.counted, exp.count = "ACK", true, count(strings.ToLower(kind))
		}
	case "STATUS":
		exp.reply = "STATUS_REPLY"
	}
	var kv []interface{}
	for k, v := range message {
		if k != "type" && k != "id" {
			kv = append(kv, k, v)
		}
	}
	return c.conn().send(ctx, exp, kv...)
}

// Done is closed when the reply has arrived or the connection failed.
func (call *Call) Done() <-chan struct{} { return call.done }

// Wait gives the reply: an ERROR reply too (reply.Err() is its *Error), with a nil error. The
// error is the connection's when it failed first, or ctx's when ctx ends first; then the call
// stays pending and Wait may be called again.
func (call *Call) Wait(ctx context.Context) (*Reply, error) {
	select {
	case <-call.done:
		return call.reply, call.err
	case <-ctx.Done():
		return nil, fmt.Errorf("kvmatch: no reply to request %d: %w", call.ID, ctx.Err())
	}
}

// abandon gives the call up after its caller stopped waiting: it leaves the calls waiting, and its
// reply is dropped on arrival.
func (call *Call) abandon() {
	cn := call.c
	cn.mu.Lock()
	defer cn.mu.Unlock()
	if cn.calls[call.ID] != call {
		return // answered meanwhile, or the connection failed
	}
	delete(cn.calls, call.ID)
	cn.abandoned[call.ID] = call.expect
	if len(cn.abandoned) <= maxAbandoned {
		return
	}
	lowest := call.ID
	for id := range cn.abandoned {
		if id < lowest {
			lowest = id
		}
	}
	delete(cn.abandoned, lowest)
	if lowest > cn.forgotten {
		cn.forgotten = lowest
	}
}

// ---- blocking -----------------------------------------------------------------------------------

// Do sends a Call's request and waits for it: an ERROR reply is returned as its *Error; on ctx's
// end the request is given up.
func do(ctx context.Context, call *Call, err error) (*Reply, error) {
	if err != nil {
		return nil, err
	}
	reply, err := call.Wait(ctx)
	if err != nil {
		call.abandon()
		return nil, err
	}
	if err := reply.Err(); err != nil {
		return reply, err
	}
	return reply, nil
}

// Route asks for one decision per route, in the routes' order. A route that failed has a
// non-OK Status (Decision.Err); the error is for the whole request (an ERROR reply, the
// connection, ctx).
func (c *Client) Route(ctx context.Context, routes ...RouteRequest) ([]Decision, error) {
	call, err := c.SendRoute(ctx, routes)
	reply, err := do(ctx, call, err)
	if err != nil {
		return nil, err
	}
	return reply.Decisions, nil
}

// Lifecycle reports events and returns one ACK item per event (AckItem.Err for each).
func (c *Client) Lifecycle(ctx context.Context, events ...LifecycleEvent) ([]AckItem, error) {
	call, err := c.SendLifecycle(ctx, events)
	reply, err := do(ctx, call, err)
	if err != nil {
		return nil, err
	}
	return reply.Items, nil
}

// Report reports one event; the error is the request's or the event's own (an *Error).
func (c *Client) Report(ctx context.Context, event LifecycleEvent) error {
	items, err := c.Lifecycle(ctx, event)
	if err != nil {
		return err
	}
	return items[0].Err()
}

func (c *Client) admin(ctx context.Context, kind, action, key string, list []interface{}) (*Reply, error) {
	exp := expected{request: kind, reply: "ACK", counted: true, count: len(list)}
	call, err := c.conn().send(ctx, exp, "action", action, key, list)
	return do(ctx, call, err)
}

func (c *Client) workers(ctx context.Context, action string, workers []Worker) ([]AckItem, error) {
	list := make([]interface{}, len(workers))
	for i := range workers {
		list[i] = &workers[i]
	}
	reply, err := c.admin(ctx, "WORKERS", action, "workers", list)
	if err != nil {
		return nil, err
	}
	return reply.Items, nil
}

// AddWorkers adds workers (Pool, Worker and optionally Name, EventEndpoint, ReplayEndpoint,
// DPRank, Healthy); one ACK item per worker.
func (c *Client) AddWorkers(ctx context.Context, workers ...Worker) ([]AckItem, error) {
	return c.workers(ctx, "add", workers)
}

// RemoveWorkers removes workers (Pool and Worker); one ACK item per worker.
func (c *Client) RemoveWorkers(ctx context.Context, workers ...Worker) ([]AckItem, error) {
	return c.workers(ctx, "remove", workers)
}

// UpdateWorkers sets Healthy (required) of workers named by Pool and Worker: the router's own
// health verdict. One ACK item per worker.
func (c *Client) UpdateWorkers(ctx context.Context, workers ...Worker) ([]AckItem, error) {
	return c.workers(ctx, "update", workers)
}

// ListWorkers lists the workers with their runtime fields; pool "" lists every pool's.
func (c *Client) ListWorkers(ctx context.Context, pool string) ([]Worker, error) {
	kv := []interface{}{"action", "list"}
	if pool != "" {
		kv = append(kv, "pool", pool)
	}
	call, err := c.conn().send(ctx, expected{request: "WORKERS", reply: "WORKER_LIST"}, kv...)
	reply, err := do(ctx, call, err)
	if err != nil {
		return nil, err
	}
	return reply.Workers, nil
}

func (c *Client) pools(ctx context.Context, action string, pools []Pool) ([]AckItem, error) {
	list := make([]interface{}, len(pools))
	for i := range pools {
		list[i] = &pools[i]
	}
	reply, err := c.admin(ctx, "POOLS", action, "pools", list)
	if err != nil {
		return nil, err
	}
	return reply.Items, nil
}

// AddPools adds pools (Name and BlockSize required); one ACK item per pool.
func (c *Client) AddPools(ctx context.Context, pools ...Pool) ([]AckItem, error) {
	return c.pools(ctx, "add", pools)
}

// UpdatePools changes pools' model, policy or params; one ACK item per pool.
func (c *Client) UpdatePools(ctx context.Context, pools ...Pool) ([]AckItem, error) {
	return c.pools(ctx, "update", pools)
}

// RemovePools ends the named pools: each one's workers are removed (their active work ends with
// outcome records) and everything the pool holds is released. One ACK item per name (ErrNotFound
// for a pool that does not exist).
func (c *Client) RemovePools(ctx context.Context, names ...string) ([]AckItem, error) {
	pools := make([]Pool, len(names))
	for i, name := range names {
		pools[i] = Pool{Name: name}
	}
	return c.pools(ctx, "remove", pools)
}

// ListPools lists the pools with every policy parameter.
func (c *Client) ListPools(ctx context.Context) ([]Pool, error) {
	call, err := c.conn().send(ctx, expected{request: "POOLS", reply: "POOL_LIST"}, "action", "list")
	reply, err := do(ctx, call, err)
	if err != nil {
		return nil, err
	}
	return reply.Pools, nil
}

// Status asks for the server's STATUS_REPLY.
func (c *Client) Status(ctx context.Context) (*StatusReply, error) {
	call, err := c.conn().send(ctx, expected{request: "STATUS", reply: "STATUS_REPLY"})
	reply, err := do(ctx, call, err)
	if err != nil {
		return nil, err
	}
	return &reply.Status, nil
}

// ---- frames -------------------------------------------------------------------------------------

// encodeMessage writes {"type": kind, "id": id, key, value, ...}. A value that is a
// []interface{} of custom encoders is written element by element.
func encodeMessage(kind string, id uint64, kv ...interface{}) ([]byte, error) {
	var buf bytes.Buffer
	e := msgpack.NewEncoder(&buf)
	f := append(fields{"type", kind, "id", id}, kv...)
	if err := f.encode(e); err != nil {
		return nil, newError(ErrInvalidArgument, "cannot encode %s: %v", kind, err)
	}
	return buf.Bytes(), nil
}

// writeFrame writes the frame in one Write; the count is the bytes of it that went out.
func writeFrame(w io.Writer, payload []byte) (int, error) {
	frame := make([]byte, 4+len(payload))
	binary.BigEndian.PutUint32(frame, uint32(len(payload)))
	copy(frame[4:], payload)
	return w.Write(frame)
}

func (cn *conn) send(ctx context.Context, exp expected, kv ...interface{}) (*Call, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	cn.mu.Lock()
	if cn.err != nil {
		cn.mu.Unlock()
		return nil, newError(ErrClosed, "the connection is closed (%v)", cn.err)
	}
	id := cn.nextID
	cn.nextID++
	cn.mu.Unlock()
	payload, err := encodeMessage(exp.request, id, kv...)
	if err != nil {
		return nil, err
	}
	if uint64(len(payload)) > uint64(cn.maxFrame) {
		return nil, newError(ErrTooLarge, "%s message encodes to %d bytes, max_frame_bytes is %d",
			exp.request, len(payload), cn.maxFrame)
	}
	call := &Call{ID: id, c: cn, expect: exp, done: make(chan struct{})}
	cn.mu.Lock()
	if cn.err != nil {
		cn.mu.Unlock()
		return nil, newError(ErrClosed, "the connection is closed (%v)", cn.err)
	}
	cn.calls[id] = call // before the write: the reply may come at once
	cn.mu.Unlock()
	select {
	case cn.writeSlot <- struct{}{}:
	case <-ctx.Done():
		return nil, cn.unsent(call, ctx)
	}
	deadline, _ := ctx.Deadline()
	cn.nc.SetWriteDeadline(deadline)
	stop := onDone(ctx, func() { cn.nc.SetWriteDeadline(time.Now()) })
	n, err := writeFrame(cn.nc, payload)
	stop()
	<-cn.writeSlot
	switch {
	case err == nil:
		return call, nil
	case n == 0 && isTimeout(err):
		// Nothing of the frame went out: the stream is intact and the connection stays usable.
		return nil, cn.unsent(call, ctx)
	case isTimeout(err):
		// Part of the frame is out: the stream cannot be continued.
		cn.fail(newError(ErrTimeout, "send timed out; connection closed mid-frame"))
	default:
		cn.fail(newError(ErrClosed, "send failed: %v", err))
	}
	return nil, cn.finalErr()
}

// unsent drops a call whose request was not written because ctx ended first: the error wraps
// ctx's (context.DeadlineExceeded when the write deadline passed before ctx noticed).
func (cn *conn) unsent(call *Call, ctx context.Context) error {
	cn.mu.Lock()
	if cn.calls[call.ID] == call {
		delete(cn.calls, call.ID)
	}
	cn.mu.Unlock()
	cause := ctx.Err()
	if cause == nil {
		cause = context.DeadlineExceeded
	}
	return fmt.Errorf("kvmatch: request %d was not sent: %w", call.ID, cause)
}

func (cn *conn) finalErr() error {
	cn.mu.Lock()
	defer cn.mu.Unlock()
	return cn.err
}

// fail closes the connection once with err, failing every call in flight with it.
func (cn *conn) fail(err error) {
	cn.mu.Lock()
	defer cn.mu.Unlock()
	if cn.err != nil {
		return
	}
	cn.err = err
	cn.nc.Close()
	for id, call := range cn.calls {
		call.err = err
		close(call.done)
		delete(cn.calls, id)
	}
	cn.abandoned = map[uint64]expected{}
}

// readReply reads one frame and decodes it, within the limits of "Reading replies".
// firstReadBytes is the buffer a reply's payload starts in; a larger one doubles as it arrives.
const firstReadBytes = 64 << 10

// readPayload reads a payload of n bytes whose buffer grows as its bytes arrive: a frame that
// declares more than comes costs what came, not what it declared. io.ReadFull's errors.
func readPayload(r io.Reader, n uint32) ([]byte, error) {
	size := uint64(n)
	if size > firstReadBytes {
		size = firstReadBytes
	}
	buf := make([]byte, size)
	filled := 0
	for {
		k, err := io.ReadFull(r, buf[filled:])
		filled += k
		if err != nil {
			return nil, err
		}
		if uint64(filled) == uint64(n) {
			return buf, nil
		}
		next := 2 * uint64(len(buf))
		if next > uint64(n) {
			next = uint64(n)
		}
		grown := make([]byte, next)
		copy(grown, buf)
		buf = grown
	}
}

func (cn *conn) readReply() (*Reply, error) {
	var header [4]byte
	if n, err := io.ReadFull(cn.nc, header[:]); err != nil {
		return nil, readError(err, n > 0)
	}
	length := binary.BigEndian.Uint32(header[:])
	if length == 0 {
		return nil, newError(ErrProtocol, "reply frame declares 0 bytes")
	}
	if length > cn.maxFrame {
		return nil, newError(ErrTooLarge, "reply frame declares %d bytes, max_frame_bytes is %d", length, cn.maxFrame)
	}
	payload, err := readPayload(cn.nc, length)
	if err != nil {
		return nil, readError(err, true)
	}
	if err := checkPayload(payload); err != nil {
		return nil, err
	}
	if payload[0] < 0x80 || (payload[0] > 0x8f && payload[0] != 0xde && payload[0] != 0xdf) {
		return nil, newError(ErrParse, "a reply is a map, got msgpack type byte 0x%02x", payload[0])
	}
	var reply Reply
	if err := msgpack.NewDecoder(bytes.NewReader(payload)).Decode(&reply); err != nil {
		var ke *Error
		if errors.As(err, &ke) {
			return nil, ke
		}
		return nil, newError(ErrParse, "unreadable reply: %v", err)
	}
	return &reply, nil
}

func readError(err error, midFrame bool) error {
	switch {
	case isTimeout(err):
		return newError(ErrTimeout, "no reply before the deadline")
	case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF):
		if midFrame {
			return newError(ErrClosed, "the server closed the connection mid-frame")
		}
		return newError(ErrClosed, "the server closed the connection")
	case errors.Is(err, net.ErrClosed):
		return newError(ErrClosed, "the connection is closed")
	}
	return newError(ErrClosed, "the connection failed: %v", err)
}

// readLoop hands each reply to its call until the connection fails.
func (cn *conn) readLoop() {
	for {
		reply, err := cn.readReply()
		if err != nil {
			cn.fail(err)
			return
		}
		if err := cn.deliver(reply); err != nil {
			cn.fail(err)
			return
		}
	}
}

func (cn *conn) deliver(reply *Reply) error {
	if reply.Type == "ERROR" && reply.ID == 0 {
		// The server is closing the connection: ErrClosed whatever its code, which is named.
		return newError(ErrClosed, "the server closes the connection: %s (%d): %s",
			reply.Code.Name(), int(reply.Code), serverWords(reply.Code, reply.Message))
	}
	cn.mu.Lock()
	call, ok := cn.calls[reply.ID]
	exp, late := cn.abandoned[reply.ID]
	forgotten := reply.ID != 0 && reply.ID <= cn.forgotten
	cn.mu.Unlock()
	switch {
	case ok:
		exp = call.expect
	case late:
		// A call given up: its reply is checked, then dropped.
		if err := checkReply(reply, exp); err != nil {
			return err
		}
		cn.mu.Lock()
		delete(cn.abandoned, reply.ID)
		cn.mu.Unlock()
		return nil
	case forgotten:
		return nil
	default:
		return newError(ErrProtocol, "the server answered request %d, which is not waiting for a reply", reply.ID)
	}
	if err := checkReply(reply, exp); err != nil {
		return err
	}
	cn.mu.Lock()
	defer cn.mu.Unlock()
	if cn.calls[reply.ID] != call {
		// Given up meanwhile (dropped now), or the connection failed (the call has its error).
		delete(cn.abandoned, reply.ID)
		return nil
	}
	delete(cn.calls, reply.ID)
	call.reply = reply
	close(call.done)
	return nil
}

// checkReply: an ERROR, or a reply of the request's type holding one decision or item per item of
// the request.
func checkReply(reply *Reply, exp expected) error {
	if reply.Type == "ERROR" {
		return nil
	}
	if reply.Type != exp.reply {
		return newError(ErrProtocol, "the server answered request %d (%s) with %s", reply.ID, exp.request, reply.Type)
	}
	if !exp.counted {
		return nil
	}
	got, what := len(reply.Items), "items"
	if reply.Type == "DECISION" {
		got, what = len(reply.Decisions), "decisions"
	}
	if got != exp.count {
		return newError(ErrProtocol, "the server answered request %d with %d %s for %d", reply.ID, got, what, exp.count)
	}
	return nil
}

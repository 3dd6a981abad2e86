// SPDX-License-Identifier: Apache-2.0

package kvmatch

import (
	"fmt"
	"math"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// The messages of docs/PROTOCOL.md. Go names are the wire names in CamelCase (chosen_worker is
// ChosenWorker); the msgpack tags are the wire names. A pointer field is one whose absence means
// something other than its zero value (OwnerWorker: no worker holds block 0; LoadValue: the
// policy weighed no load; CachedTokens: unknown).

// Limits are the server's limits from WELCOME; a client stays within them in what it sends.
type Limits struct {
	MaxFrameBytes     uint32 `msgpack:"max_frame_bytes"`
	MaxObjects        uint32 `msgpack:"max_objects"`
	MaxBatchItems     uint32 `msgpack:"max_batch_items"`
	MaxTokensPerRoute uint32 `msgpack:"max_tokens_per_route"`
	MaxHashesPerRoute uint32 `msgpack:"max_hashes_per_route"`
	MaxCandidates     uint32 `msgpack:"max_candidates"`
	MaxParams         uint32 `msgpack:"max_params"`
	MaxStringBytes    uint32 `msgpack:"max_string_bytes"`
}

// Welcome is the server's answer to the handshake.
type Welcome struct {
	Protocol       uint32 `msgpack:"protocol"`
	KvmatchVersion string `msgpack:"kvmatch_version"`
	Server         string `msgpack:"server"`
	Limits         Limits `msgpack:"limits"`
}

// RouteRequest is one route of a ROUTE. Exactly one of Tokens and Hashes is sent: Hashes when it
// is not nil, else Tokens (nil or empty: a prompt shorter than one block). Zero values of the
// optional fields are not sent.
type RouteRequest struct {
	RequestID            string
	AttemptID            string
	Model                string
	Pool                 string
	Endpoint             string
	Tokens               []uint32
	Hashes               []uint64
	BlockSize            uint32 // with Hashes: the block size they were computed with
	LoraName             string
	CacheSalt            string
	Candidates           []uint32 // nil: every worker of the pool
	Brief                bool     // no candidate rows in the decision
	WarmUps              bool     // this router carries out the warm-ups decisions ask for
	Policy               string
	PromptTokens         *uint64
	ExpectedOutputTokens *uint64
}

// Event names of LIFECYCLE.
const (
	EventDispatched = "DISPATCHED"
	EventFirstToken = "FIRST_TOKEN"
	EventFinished   = "FINISHED"
)

// LifecycleEvent is one report of what happened to a routed request. DecisionID 0 and an empty
// RequestID are not sent (the server counts decision ids from 1); at least one of them is
// required.
type LifecycleEvent struct {
	Event      string
	DecisionID uint64
	RequestID  string
	AttemptID  string
	Worker     *uint32  // the worker actually used, if known
	ElapsedMs  *float64 // router clock: ms from the request's arrival to this event
	// FINISHED only.
	Outcome      string // empty: the server derives it (OutcomeFromStream)
	FinishReason string
	DoneSeen     bool
	HTTPStatus   uint32 // 0: unknown
	Error        string
	CachedTokens *uint64 // nil: unknown (not 0)
	PromptTokens *uint64
	OutputTokens *uint64
	Retries      uint32
}

// WorkerLoad is the load this kvmatch instance saw on a worker.
type WorkerLoad struct {
	InFlight             uint32 `msgpack:"in_flight"`
	PendingPrefillTokens uint64 `msgpack:"pending_prefill_tokens"`
	ActiveDecodeBlocks   uint64 `msgpack:"active_decode_blocks"`
}

// Worker is a worker map: what WORKERS add / remove / update send (Pool, Worker, Name,
// EventEndpoint, ReplayEndpoint, DPRank, Healthy), and, in WORKER_LIST and STATUS_REPLY, the
// runtime fields too.
type Worker struct {
	Pool           string      `msgpack:"pool"`
	Worker         uint32      `msgpack:"worker"`
	Name           string      `msgpack:"name"`
	EventEndpoint  string      `msgpack:"event_endpoint"`
	ReplayEndpoint string      `msgpack:"replay_endpoint"`
	DPRank         *uint32     `msgpack:"dp_rank"`
	Healthy        *bool       `msgpack:"healthy"`
	State          string      `msgpack:"state"`
	Blocks         uint64      `msgpack:"blocks"`
	LastEventAgeS  *float64    `msgpack:"last_event_age_s"`
	ExpectedSeq    *uint64     `msgpack:"expected_seq"`
	Load           *WorkerLoad `msgpack:"load"`
	Breaker        string      `msgpack:"breaker"`
	Failures       uint32      `msgpack:"failures"`
	Eligible       *bool       `msgpack:"eligible"`
}

// Pool is a pool map of POOLS add / update and POOL_LIST. BlockSize 0 is not sent (add then
// fails that pool with ErrBlockSize; update leaves it unchanged). HashLookaheadTokens (the
// engines' lookahead hashing, set in add only) 0 is not sent: none. OffloadChunkBlocks (blocks per
// chunk of the engines' KV offloading connector, set in add only) 0 is not sent: 1. Engine (the
// engine model preset the pool's workers run, "llama3-8b-h100" or "llama3-70b-h100x4"; set in add,
// update may only repeat the pool's own) "" is not sent: the default llama3-8b-h100 in add,
// unchanged in update; POOL_LIST leaves it "" for a pool whose model is none of the presets.
type Pool struct {
	Name                string             `msgpack:"name"`
	Model               string             `msgpack:"model"`
	BlockSize           uint32             `msgpack:"block_size"`
	HashLookaheadTokens uint32             `msgpack:"hash_lookahead_tokens"`
	OffloadChunkBlocks  uint32             `msgpack:"offload_chunk_blocks"`
	Policy              string             `msgpack:"policy"`
	Engine              string             `msgpack:"engine"`
	Params              map[string]float64 `msgpack:"params"`
}

// Candidate is one candidate row of a decision (11 positional values on the wire).
type Candidate struct {
	Worker               uint32
	Depth                uint32
	DeviceBlocks         uint32
	HostBlocks           uint32
	DiskBlocks           uint32
	InFlight             uint32
	PendingPrefillTokens uint64
	ActiveDecodeBlocks   uint64
	Cost                 *float64 // nil: not weighed (round_robin, an ineligible worker)
	State                string
	Eligible             bool
}

// Decision answers one route. Status OK: decided; else Message says why and only the ids are set.
type Decision struct {
	Status       Code     `msgpack:"status"`
	Message      string   `msgpack:"message"`
	RequestID    string   `msgpack:"request_id"`
	AttemptID    string   `msgpack:"attempt_id"`
	DecisionID   uint64   `msgpack:"decision_id"`
	Pool         string   `msgpack:"pool"`
	ChosenWorker uint32   `msgpack:"chosen_worker"`
	ChosenDepth  uint32   `msgpack:"chosen_depth"`
	ChosenState  string   `msgpack:"chosen_state"`
	OwnerWorker  *uint32  `msgpack:"owner_worker"` // nil: no worker holds block 0
	OwnerDepth   uint32   `msgpack:"owner_depth"`
	OwnerState   string   `msgpack:"owner_state"`
	NBlocks      uint32   `msgpack:"n_blocks"`
	BlockSize    uint32   `msgpack:"block_size"`
	Source       string   `msgpack:"source"`
	Policy       string   `msgpack:"policy"`
	Reason       string   `msgpack:"reason"`
	LoadKind     string   `msgpack:"load_kind"`
	LoadScope    string   `msgpack:"load_scope"`
	LoadValue    *float64 `msgpack:"load_value"` // nil: the policy weighed no load
	// With every LoadScope but "this_instance" (PROTOCOL.md, CLUSTER.md): the other instances
	// whose load was added, since the oldest contribution used (nil: none, or this_instance), and
	// the stale instances' ids, comma-separated ("" when none).
	LoadInstances      uint32      `msgpack:"load_instances"`
	LoadOldestAgeMs    *float64    `msgpack:"load_oldest_age_ms"`
	LoadStaleInstances string      `msgpack:"load_stale_instances"`
	Candidates         []Candidate `msgpack:"candidates"`
	// nil: the decision asks for no warm-up (always, for a route without WarmUps).
	WarmUp *WarmUp `msgpack:"warm_up"`
}

// WarmUp is a decision's request that its router warm up another worker (docs/PROTOCOL.md,
// "Warm-ups"): send Worker the routed prompt's first Tokens tokens (Blocks whole blocks), asking
// for one output token that nobody reads, and report that request's lifecycle under DecisionID
// like any decision's. AttemptID is the route's attempt id with ":warm_up" appended.
type WarmUp struct {
	Worker     uint32 `msgpack:"worker"`
	Blocks     uint32 `msgpack:"blocks"`
	Tokens     uint64 `msgpack:"tokens"`
	DecisionID uint64 `msgpack:"decision_id"`
	AttemptID  string `msgpack:"attempt_id"`
}

// Err is nil for a decided route, else its failure as an *Error.
func (d *Decision) Err() error { return statusError(d.Status, d.Message) }

// AckItem is one status of an ACK: one per event, worker or pool of the request.
type AckItem struct {
	Status  Code   `msgpack:"status"`
	Message string `msgpack:"message"`
}

// Err is nil for an item that succeeded, else its failure as an *Error.
func (a *AckItem) Err() error { return statusError(a.Status, a.Message) }

// StatusReply answers STATUS.
type StatusReply struct {
	KvmatchVersion string   `msgpack:"kvmatch_version"`
	UptimeS        float64  `msgpack:"uptime_s"`
	Ready          bool     `msgpack:"ready"`
	Connections    uint32   `msgpack:"connections"`
	Decisions      uint64   `msgpack:"decisions"`
	RecordsDropped uint64   `msgpack:"records_dropped"`
	Backend        string   `msgpack:"backend"`
	Workers        []Worker `msgpack:"workers"`
}

// Reply is any message from the server, as decoded: Type says which fields mean something.
// ERROR: Code, Name, Message. WELCOME: Protocol, KvmatchVersion, Server, Limits. DECISION:
// KvmatchVersion, Decisions. ACK: Items. WORKER_LIST: Workers. POOL_LIST: Pools. STATUS_REPLY:
// Status (STATUS_REPLY's own "decisions" count is Status.Decisions).
type Reply struct {
	Type           string
	ID             uint64
	Code           Code
	Name           string
	Message        string
	Protocol       uint32
	Server         string
	Limits         Limits
	KvmatchVersion string
	Decisions      []Decision
	Items          []AckItem
	Workers        []Worker
	Pools          []Pool
	Status         StatusReply
}

// DecodeMsgpack reads a reply map. Unknown keys are skipped, and so are entries whose key is not a
// str; a key that appears twice is refused.
func (r *Reply) DecodeMsgpack(d *msgpack.Decoder) error {
	n, err := d.DecodeMapLen()
	if err != nil {
		return err
	}
	if n < 0 {
		return newError(ErrParse, "a reply is a map, got nil")
	}
	seen := make(map[string]bool, n)
	for i := 0; i < n; i++ {
		key, ok, err := mapKey(d)
		if err != nil {
			return err
		}
		if !ok {
			continue
		}
		if seen[key] {
			return newError(ErrParse, "key %q appears twice", key)
		}
		seen[key] = true
		switch key {
		case "type":
			err = d.Decode(&r.Type)
		case "id":
			if err := decodeReplyID(d, &r.ID); err != nil {
				return err
			}
		case "code":
			err = decodeCode(d, &r.Code)
		case "name":
			err = d.Decode(&r.Name)
		case "message":
			err = d.Decode(&r.Message)
		case "protocol":
			err = decodeU32(d, &r.Protocol)
		case "server":
			err = d.Decode(&r.Server)
		case "limits":
			err = d.Decode(&r.Limits)
		case "kvmatch_version":
			err = d.Decode(&r.KvmatchVersion)
			r.Status.KvmatchVersion = r.KvmatchVersion
		case "decisions":
			// DECISION's list, or STATUS_REPLY's count of decisions since start.
			var c byte
			if c, err = d.PeekCode(); err == nil {
				if isArrayCode(c) {
					err = d.Decode(&r.Decisions)
				} else {
					err = decodeU64(d, &r.Status.Decisions)
				}
			}
		case "items":
			err = d.Decode(&r.Items)
		case "workers":
			err = d.Decode(&r.Workers)
			r.Status.Workers = r.Workers
		case "pools":
			err = d.Decode(&r.Pools)
		case "uptime_s":
			err = d.Decode(&r.Status.UptimeS)
		case "ready":
			err = d.Decode(&r.Status.Ready)
		case "connections":
			err = decodeU32(d, &r.Status.Connections)
		case "records_dropped":
			err = decodeU64(d, &r.Status.RecordsDropped)
		case "backend":
			err = d.Decode(&r.Status.Backend)
		default:
			err = skipValue(d)
		}
		if err != nil {
			return newError(ErrParse, "%s: %v", key, err)
		}
	}
	return nil
}

// decodeReplyID reads a reply's id: a uint64, or nil (0: only a connection-level ERROR has none).
// Anything else (a float, which would pass for the integer it equals, a bool, a negative int, a
// str, a container) is ErrProtocol, which closes the connection, as an id not waiting does.
func decodeReplyID(d *msgpack.Decoder, p *uint64) error {
	v, err := d.DecodeInterfaceLoose()
	if err != nil {
		return newError(ErrParse, "id: %v", err)
	}
	switch n := v.(type) {
	case nil:
		*p = 0
		return nil
	case uint64:
		*p = n
		return nil
	case int64:
		if n >= 0 {
			*p = uint64(n)
			return nil
		}
	}
	return newError(ErrProtocol, "a reply's id %.80s (%T) is not a non-negative integer",
		fmt.Sprint(v), v)
}

func isArrayCode(c byte) bool {
	return (c >= 0x90 && c <= 0x9f) || c == 0xdc || c == 0xdd
}

func isMapCode(c byte) bool {
	return (c >= 0x80 && c <= 0x8f) || c == 0xde || c == 0xdf
}

// skipValue skips a value no field takes (an unknown key's, a candidate row's past its 11th), and
// refuses a map within it, at any depth, that holds a key twice, as the reply's other maps are
// refused (docs/PROTOCOL.md); an entry whose key is not a str is skipped whole, as everywhere.
// checkPayload has bounded the nesting.
func skipValue(d *msgpack.Decoder) error {
	c, err := d.PeekCode()
	if err != nil {
		return err
	}
	switch {
	case isMapCode(c):
		return decodeMap(d, func(string) error { return skipValue(d) })
	case isArrayCode(c):
		n, err := d.DecodeArrayLen()
		if err != nil {
			return err
		}
		for i := 0; i < n; i++ {
			if err := skipValue(d); err != nil {
				return err
			}
		}
		return nil
	}
	return d.Skip()
}

// Err is nil unless the reply is an ERROR, which it returns as an *Error with the server's code
// (ErrProtocol for a code that is not negative, which names no failure).
func (r *Reply) Err() error {
	if r.Type != "ERROR" {
		return nil
	}
	code := r.Code
	if code >= OK {
		code = ErrProtocol
	}
	return &Error{Code: code, Message: serverWords(code, r.Message)}
}

// ---- encoding ---------------------------------------------------------------------------------

// fields is a msgpack map under construction: keys and values in order, written with its length.
type fields []interface{}

func (f fields) encode(e *msgpack.Encoder) error {
	if err := e.EncodeMapLen(len(f) / 2); err != nil {
		return err
	}
	for _, v := range f {
		if err := e.Encode(v); err != nil {
			return err
		}
	}
	return nil
}

func (f fields) str(key, v string) fields {
	if v != "" {
		return append(f, key, v)
	}
	return f
}

func (r *RouteRequest) EncodeMsgpack(e *msgpack.Encoder) error {
	f := fields{"request_id", r.RequestID}
	f = f.str("attempt_id", r.AttemptID).str("model", r.Model).str("pool", r.Pool)
	f = f.str("endpoint", r.Endpoint).str("lora_name", r.LoraName).str("cache_salt", r.CacheSalt)
	f = f.str("policy", r.Policy)
	if r.Hashes != nil {
		f = append(f, "hashes", r.Hashes)
		if r.BlockSize != 0 {
			f = append(f, "block_size", r.BlockSize)
		}
	} else if r.Tokens != nil {
		f = append(f, "tokens", r.Tokens)
	} else {
		f = append(f, "tokens", []uint32{})
	}
	if r.Candidates != nil {
		f = append(f, "candidates", r.Candidates)
	}
	if r.Brief {
		f = append(f, "brief", true)
	}
	if r.WarmUps {
		f = append(f, "warm_ups", true)
	}
	if r.PromptTokens != nil {
		f = append(f, "prompt_tokens", *r.PromptTokens)
	}
	if r.ExpectedOutputTokens != nil {
		f = append(f, "expected_output_tokens", *r.ExpectedOutputTokens)
	}
	return f.encode(e)
}

func (ev *LifecycleEvent) EncodeMsgpack(e *msgpack.Encoder) error {
	f := fields{}.str("event", ev.Event)
	if ev.DecisionID != 0 {
		f = append(f, "decision_id", ev.DecisionID)
	}
	f = f.str("request_id", ev.RequestID).str("attempt_id", ev.AttemptID)
	if ev.Worker != nil {
		f = append(f, "worker", *ev.Worker)
	}
	if ev.ElapsedMs != nil {
		f = append(f, "elapsed_ms", *ev.ElapsedMs)
	}
	f = f.str("outcome", ev.Outcome).str("finish_reason", ev.FinishReason).str("error", ev.Error)
	if ev.DoneSeen {
		f = append(f, "done_seen", true)
	}
	if ev.HTTPStatus != 0 {
		f = append(f, "http_status", ev.HTTPStatus)
	}
	for _, n := range []struct {
		key string
		v   *uint64
	}{{"cached_tokens", ev.CachedTokens}, {"prompt_tokens", ev.PromptTokens}, {"output_tokens", ev.OutputTokens}} {
		if n.v != nil {
			f = append(f, n.key, *n.v)
		}
	}
	if ev.Retries != 0 {
		f = append(f, "retries", ev.Retries)
	}
	return f.encode(e)
}

// EncodeMsgpack writes the fields a WORKERS request carries (the runtime fields are replies' only).
func (w *Worker) EncodeMsgpack(e *msgpack.Encoder) error {
	f := fields{"pool", w.Pool, "worker", w.Worker}
	f = f.str("name", w.Name).str("event_endpoint", w.EventEndpoint).str("replay_endpoint", w.ReplayEndpoint)
	if w.DPRank != nil {
		f = append(f, "dp_rank", *w.DPRank)
	}
	if w.Healthy != nil {
		f = append(f, "healthy", *w.Healthy)
	}
	return f.encode(e)
}

func (p *Pool) EncodeMsgpack(e *msgpack.Encoder) error {
	f := fields{"name", p.Name}
	f = f.str("model", p.Model).str("policy", p.Policy).str("engine", p.Engine)
	if p.BlockSize != 0 {
		f = append(f, "block_size", p.BlockSize)
	}
	if p.HashLookaheadTokens != 0 {
		f = append(f, "hash_lookahead_tokens", p.HashLookaheadTokens)
	}
	if p.OffloadChunkBlocks != 0 {
		f = append(f, "offload_chunk_blocks", p.OffloadChunkBlocks)
	}
	if p.Params != nil {
		f = append(f, "params", p.Params)
	}
	return f.encode(e)
}

// ---- decoding ---------------------------------------------------------------------------------

// DecodeMsgpack reads a candidate row: an array whose first 11 values are the row's fields in
// order (nil: absent; later values, which a newer server may append, are skipped).
func (c *Candidate) DecodeMsgpack(d *msgpack.Decoder) error {
	n, err := d.DecodeArrayLen()
	if err != nil {
		return err
	}
	*c = Candidate{Eligible: true}
	u32 := []*uint32{&c.Worker, &c.Depth, &c.DeviceBlocks, &c.HostBlocks, &c.DiskBlocks, &c.InFlight}
	for i := 0; i < n; i++ {
		switch {
		case i < 6:
			err = decodeU32(d, u32[i])
		case i == 6:
			err = decodeU64(d, &c.PendingPrefillTokens)
		case i == 7:
			err = decodeU64(d, &c.ActiveDecodeBlocks)
		case i == 8:
			err = d.Decode(&c.Cost)
		case i == 9:
			err = d.Decode(&c.State)
		case i == 10:
			var eligible *bool
			if err = d.Decode(&eligible); err == nil && eligible != nil {
				c.Eligible = *eligible
			}
		default:
			err = skipValue(d)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// DecodeMsgpack reads a decision map. Unknown keys are skipped (and entries whose key is not a
// str); a key that appears twice is refused, and so is an integer field whose value is outside
// its type (a chosen_worker of 2^32 + 2 is no worker, not worker 2) and a decided one (Status
// OK) without decision_id, chosen_worker or source (nil is absent), which would read as decision
// 0 on worker 0. A warm_up of nil is absent; any other is read by WarmUp.DecodeMsgpack.
func (dc *Decision) DecodeMsgpack(d *msgpack.Decoder) error {
	n, err := d.DecodeMapLen()
	if err != nil {
		return err
	}
	*dc = Decision{}
	strs := map[string]*string{"message": &dc.Message, "request_id": &dc.RequestID,
		"attempt_id": &dc.AttemptID, "pool": &dc.Pool, "chosen_state": &dc.ChosenState,
		"owner_state": &dc.OwnerState, "source": &dc.Source, "policy": &dc.Policy,
		"reason": &dc.Reason, "load_kind": &dc.LoadKind, "load_scope": &dc.LoadScope,
		"load_stale_instances": &dc.LoadStaleInstances}
	u32s := map[string]*uint32{"chosen_worker": &dc.ChosenWorker, "chosen_depth": &dc.ChosenDepth,
		"owner_depth": &dc.OwnerDepth, "n_blocks": &dc.NBlocks, "block_size": &dc.BlockSize,
		"load_instances": &dc.LoadInstances}
	seen, present := make(map[string]bool, n), make(map[string]bool, n)
	for i := 0; i < n; i++ {
		key, ok, err := mapKey(d)
		if err != nil {
			return err
		}
		if !ok {
			continue
		}
		if seen[key] {
			return newError(ErrParse, "decision key %q appears twice", key)
		}
		seen[key] = true
		if c, err := d.PeekCode(); err != nil {
			return err
		} else if c == msgpcode.Nil {
			if err := d.Skip(); err != nil {
				return err
			}
			continue
		}
		present[key] = true
		switch key {
		case "status":
			err = decodeCode(d, &dc.Status)
		case "decision_id":
			err = decodeU64(d, &dc.DecisionID)
		case "owner_worker":
			err = decodeOptional(d, &dc.OwnerWorker, decodeU32)
		case "load_value":
			err = d.Decode(&dc.LoadValue)
		case "load_oldest_age_ms":
			err = d.Decode(&dc.LoadOldestAgeMs)
		case "candidates":
			err = d.Decode(&dc.Candidates)
		case "warm_up":
			dc.WarmUp = new(WarmUp)
			err = dc.WarmUp.DecodeMsgpack(d)
		default:
			if p, ok := strs[key]; ok {
				err = d.Decode(p)
			} else if p, ok := u32s[key]; ok {
				err = decodeU32(d, p)
			} else {
				err = skipValue(d)
			}
		}
		if err != nil {
			return fmt.Errorf("%s: %w", key, err)
		}
	}
	if dc.Status == OK {
		for _, key := range []string{"decision_id", "chosen_worker", "source"} {
			if !present[key] {
				return newError(ErrParse, "a decided decision has no %s", key)
			}
		}
	}
	return nil
}

// warmUpKeys are the keys of a decision's warm_up map, each required.
var warmUpKeys = []string{"worker", "blocks", "tokens", "decision_id", "attempt_id"}

// DecodeMsgpack reads a decision's warm_up map. Each of its five keys is required (nil is
// absent): a warm-up without its worker or decision id would read as one for worker 0 or
// decision 0. A key that appears twice, an integer outside its field's type and an attempt_id
// that is not a str are refused; unknown keys (and entries whose key is not a str) are skipped.
func (w *WarmUp) DecodeMsgpack(d *msgpack.Decoder) error {
	*w = WarmUp{}
	present := make(map[string]bool, len(warmUpKeys))
	err := decodeMap(d, func(key string) error {
		if c, err := d.PeekCode(); err != nil {
			return err
		} else if c == msgpcode.Nil {
			return d.Skip()
		}
		present[key] = true
		switch key {
		case "worker":
			return decodeU32(d, &w.Worker)
		case "blocks":
			return decodeU32(d, &w.Blocks)
		case "tokens":
			return decodeU64(d, &w.Tokens)
		case "decision_id":
			return decodeU64(d, &w.DecisionID)
		case "attempt_id":
			return d.Decode(&w.AttemptID)
		}
		return skipValue(d)
	})
	if err != nil {
		return err
	}
	for _, key := range warmUpKeys {
		if !present[key] {
			return newError(ErrParse, "a warm_up has no %s", key)
		}
	}
	return nil
}

// The other maps of replies are read key by key as well: unknown keys (and entries whose key is
// not a str) are skipped, and a key that appears twice and an integer outside its field's type are
// refused, as in a decision (a max_frame_bytes of 2^32 + 4096 is no limit of 4096, an ACK item's
// status of 2^63 no negative code).

// DecodeMsgpack reads WELCOME's limits map, each limit a u32.
func (l *Limits) DecodeMsgpack(d *msgpack.Decoder) error {
	*l = Limits{}
	u32s := map[string]*uint32{"max_frame_bytes": &l.MaxFrameBytes, "max_objects": &l.MaxObjects,
		"max_batch_items": &l.MaxBatchItems, "max_tokens_per_route": &l.MaxTokensPerRoute,
		"max_hashes_per_route": &l.MaxHashesPerRoute, "max_candidates": &l.MaxCandidates,
		"max_params": &l.MaxParams, "max_string_bytes": &l.MaxStringBytes}
	return decodeMap(d, func(key string) error {
		if p, ok := u32s[key]; ok {
			return decodeU32(d, p)
		}
		return skipValue(d)
	})
}

// DecodeMsgpack reads an ACK item: its status is an int64.
func (a *AckItem) DecodeMsgpack(d *msgpack.Decoder) error {
	*a = AckItem{}
	return decodeMap(d, func(key string) error {
		switch key {
		case "status":
			return decodeCode(d, &a.Status)
		case "message":
			return d.Decode(&a.Message)
		}
		return skipValue(d)
	})
}

// DecodeMsgpack reads a worker's load map.
func (l *WorkerLoad) DecodeMsgpack(d *msgpack.Decoder) error {
	*l = WorkerLoad{}
	return decodeMap(d, func(key string) error {
		switch key {
		case "in_flight":
			return decodeU32(d, &l.InFlight)
		case "pending_prefill_tokens":
			return decodeU64(d, &l.PendingPrefillTokens)
		case "active_decode_blocks":
			return decodeU64(d, &l.ActiveDecodeBlocks)
		}
		return skipValue(d)
	})
}

// DecodeMsgpack reads a worker map of WORKER_LIST or STATUS_REPLY.
func (w *Worker) DecodeMsgpack(d *msgpack.Decoder) error {
	*w = Worker{}
	strs := map[string]*string{"pool": &w.Pool, "name": &w.Name,
		"event_endpoint": &w.EventEndpoint, "replay_endpoint": &w.ReplayEndpoint,
		"state": &w.State, "breaker": &w.Breaker}
	return decodeMap(d, func(key string) error {
		switch key {
		case "worker":
			return decodeU32(d, &w.Worker)
		case "dp_rank":
			return decodeOptional(d, &w.DPRank, decodeU32)
		case "healthy":
			return d.Decode(&w.Healthy)
		case "blocks":
			return decodeU64(d, &w.Blocks)
		case "last_event_age_s":
			return d.Decode(&w.LastEventAgeS)
		case "expected_seq":
			return decodeOptional(d, &w.ExpectedSeq, decodeU64)
		case "load":
			return d.Decode(&w.Load)
		case "failures":
			return decodeU32(d, &w.Failures)
		case "eligible":
			return d.Decode(&w.Eligible)
		}
		if p, ok := strs[key]; ok {
			return d.Decode(p)
		}
		return skipValue(d)
	})
}

// DecodeMsgpack reads a pool map of POOL_LIST.
func (p *Pool) DecodeMsgpack(d *msgpack.Decoder) error {
	*p = Pool{}
	return decodeMap(d, func(key string) error {
		switch key {
		case "name":
			return d.Decode(&p.Name)
		case "model":
			return d.Decode(&p.Model)
		case "block_size":
			return decodeU32(d, &p.BlockSize)
		case "hash_lookahead_tokens":
			return decodeU32(d, &p.HashLookaheadTokens)
		case "offload_chunk_blocks":
			return decodeU32(d, &p.OffloadChunkBlocks)
		case "policy":
			return d.Decode(&p.Policy)
		case "engine":
			return d.Decode(&p.Engine)
		case "params":
			return decodeParams(d, &p.Params)
		}
		return skipValue(d)
	})
}

// decodeMap reads a map, handing each str key to field, which reads the key's value (skips it, for
// a key it does not know). A key that appears twice, a field's or not, is refused. nil reads as an
// empty map.
func decodeMap(d *msgpack.Decoder, field func(key string) error) error {
	n, err := d.DecodeMapLen()
	if err != nil {
		return err
	}
	var seen map[string]bool
	for i := 0; i < n; i++ {
		key, ok, err := mapKey(d)
		if err != nil {
			return err
		}
		if !ok {
			continue
		}
		if seen == nil {
			seen = make(map[string]bool)
		}
		if seen[key] {
			return newError(ErrParse, "key %q appears twice", key)
		}
		seen[key] = true
		if err := field(key); err != nil {
			return fmt.Errorf("%s: %w", key, err)
		}
	}
	return nil
}

// decodeParams reads a pool's params: a map of str names to numbers, nil for nil. As for the C
// client, a name that is not a str, or that appears twice, is refused.
func decodeParams(d *msgpack.Decoder, p *map[string]float64) error {
	n, err := d.DecodeMapLen()
	if err != nil || n < 0 {
		*p = nil
		return err
	}
	params := make(map[string]float64)
	for i := 0; i < n; i++ {
		c, err := d.PeekCode()
		if err != nil {
			return err
		}
		if !msgpcode.IsString(c) {
			return fmt.Errorf("a parameter name must be a str, got msgpack type byte 0x%02x", c)
		}
		name, err := d.DecodeString()
		if err != nil {
			return err
		}
		if _, twice := params[name]; twice {
			return newError(ErrParse, "parameter %q appears twice", name)
		}
		var v float64
		if err := d.Decode(&v); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		params[name] = v
	}
	*p = params
	return nil
}

// mapKey reads the key of a map entry. A key that is not a str (docs/PROTOCOL.md: such entries are
// ignored) is skipped with its value, whatever either holds, and ok is false.
func mapKey(d *msgpack.Decoder) (key string, ok bool, err error) {
	c, err := d.PeekCode()
	if err != nil {
		return "", false, err
	}
	if !msgpcode.IsString(c) {
		if err := d.Skip(); err != nil {
			return "", false, err
		}
		return "", false, d.Skip()
	}
	key, err = d.DecodeString()
	return key, err == nil, err
}

// decodeInt reads an int in lo..hi (nil: 0, as for an absent field). msgpack's own decoding
// into a sized integer wraps a negative or wider value into range, where it would pass for
// another one.
func decodeInt(d *msgpack.Decoder, lo int64, hi uint64) (int64, uint64, error) {
	v, err := d.DecodeInterfaceLoose()
	if err != nil {
		return 0, 0, err
	}
	switch n := v.(type) {
	case nil:
		return 0, 0, nil
	case int64:
		if n >= lo && (n < 0 || uint64(n) <= hi) {
			return n, uint64(n), nil
		}
	case uint64:
		if n <= hi {
			return int64(n), n, nil
		}
	default:
		return 0, 0, fmt.Errorf("expected an int, got %T", v)
	}
	return 0, 0, fmt.Errorf("%v is outside %d..%d", v, lo, hi)
}

func decodeU32(d *msgpack.Decoder, p *uint32) error {
	_, u, err := decodeInt(d, 0, math.MaxUint32)
	*p = uint32(u)
	return err
}

func decodeU64(d *msgpack.Decoder, p *uint64) error {
	_, u, err := decodeInt(d, 0, math.MaxUint64)
	*p = u
	return err
}

func decodeCode(d *msgpack.Decoder, p *Code) error {
	i, _, err := decodeInt(d, math.MinInt64, math.MaxInt64)
	*p = Code(i)
	return err
}

// decodeOptional leaves *p nil for nil, else points it at the value decode reads.
func decodeOptional[T any](d *msgpack.Decoder, p **T, decode func(*msgpack.Decoder, *T) error) error {
	c, err := d.PeekCode()
	if err != nil {
		return err
	}
	if c == msgpcode.Nil {
		*p = nil
		return d.Skip()
	}
	v := new(T)
	if err := decode(d, v); err != nil {
		return err
	}
	*p = v
	return nil
}

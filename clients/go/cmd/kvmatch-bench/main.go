// SPDX-License-Identifier: Apache-2.0

// Command kvmatch-bench is the Go client's driver for `kvmatch bench ipc --clients`
// (scripts/bench-clients.sh): one connection, closed loop, WINDOW frames in flight, each frame
// PER_FRAME routes of the chain hashes read from SCHEDULE (one prompt per line, cycled), in pool
// "main", for SECONDS. Prints one JSON line: decisions/s (routes answered with status 0 per
// second), round-trip p50 / p99 in us (send to reply, per frame), frames, errors.
//
//	kvmatch-bench ADDRESS SCHEDULE PER_FRAME WINDOW SECONDS
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"

	kvmatch "kvmatch/clients/go"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "kvmatch-bench:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	if len(args) != 5 {
		return fmt.Errorf("usage: kvmatch-bench ADDRESS SCHEDULE PER_FRAME WINDOW SECONDS")
	}
	perFrame, err1 := strconv.Atoi(args[2])
	window, err2 := strconv.Atoi(args[3])
	seconds, err3 := strconv.ParseFloat(args[4], 64)
	if err1 != nil || err2 != nil || err3 != nil || perFrame < 1 || window < 1 {
		return fmt.Errorf("bad PER_FRAME, WINDOW or SECONDS")
	}
	prompts, err := readSchedule(args[1])
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(seconds*float64(time.Second))+30*time.Second)
	defer cancel()
	c, err := kvmatch.Dial(ctx, args[0])
	if err != nil {
		return err
	}
	defer c.Close()
	// Request ids unique to this process: a later run's are new attempts, never ones in flight.
	prefix := fmt.Sprintf("go%d-", os.Getpid())
	seq, cursor := 0, 0
	type inflight struct {
		call *kvmatch.Call
		at   time.Time
	}
	var queue []inflight
	send := func() error {
		routes := make([]kvmatch.RouteRequest, perFrame)
		out := uint64(128)
		for i := range routes {
			routes[i] = kvmatch.RouteRequest{RequestID: prefix + strconv.Itoa(seq), Pool: "main",
				Hashes: prompts[cursor], ExpectedOutputTokens: &out}
			seq++
			cursor = (cursor + 1) % len(prompts)
		}
		call, err := c.SendRoute(ctx, routes)
		if err == nil {
			queue = append(queue, inflight{call, time.Now()})
		}
		return err
	}
	start := time.Now()
	end := start.Add(time.Duration(seconds * float64(time.Second)))
	for i := 0; i < window; i++ {
		if err := send(); err != nil {
			return err
		}
	}
	var rtts []float64
	ok, errors, frames := 0, 0, 0
	for len(queue) > 0 {
		head := queue[0]
		queue = queue[1:]
		reply, err := head.call.Wait(ctx)
		if err != nil {
			return err
		}
		now := time.Now()
		rtts = append(rtts, float64(now.Sub(head.at).Nanoseconds())/1e3)
		frames++
		if reply.Type != "DECISION" {
			errors++
		}
		for i := range reply.Decisions {
			if reply.Decisions[i].Status == kvmatch.OK {
				ok++
			} else {
				errors++
			}
		}
		if now.Before(end) {
			if err := send(); err != nil {
				return err
			}
		}
	}
	elapsed := time.Since(start).Seconds()
	sort.Float64s(rtts)
	pct := func(q float64) float64 {
		if len(rtts) == 0 {
			return 0
		}
		i := int(q * float64(len(rtts)))
		if i >= len(rtts) {
			i = len(rtts) - 1
		}
		return rtts[i]
	}
	return json.NewEncoder(os.Stdout).Encode(map[string]interface{}{
		"decisions_per_s": float64(ok) / elapsed, "rtt_p50_us": pct(0.50), "rtt_p99_us": pct(0.99),
		"frames": frames, "errors": errors})
}

func readSchedule(path string) ([][]uint64, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var prompts [][]uint64
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) == 0 {
			continue
		}
		p := make([]uint64, len(fields))
		for i, s := range fields {
			v, err := strconv.ParseUint(s, 10, 64)
			if err != nil {
				return nil, fmt.Errorf("%s: %v", path, err)
			}
			p[i] = v
		}
		prompts = append(prompts, p)
	}
	if len(prompts) == 0 {
		return nil, fmt.Errorf("%s: no prompts", path)
	}
	return prompts, sc.Err()
}

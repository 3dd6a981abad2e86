// SPDX-License-Identifier: Apache-2.0

// Package scorer is an example of what a Go router's scoring plugin (an endpoint picker's scorer,
// say) would call: it asks kvmatch for a decision among the pods the router's filters left and
// turns it into one score per pod in [0, 1].
//
// The worker kvmatch chose scores 1. Every other pod scores half the share of the request's
// blocks it holds (its candidate row's depth over the decision's n_blocks), so a router that
// combines several scorers still sees where the cache is. A pod kvmatch could not weigh (not in
// the pool) scores 0. When kvmatch cannot decide, Score returns the error and no scores: the
// router falls back to its other scorers.
package scorer

import (
	"context"
	"fmt"

	kvmatch "kvmatch/clients/go"
)

// Pod is an endpoint the router may send the request to, and its kvmatch worker id.
type Pod struct {
	Name   string
	Worker uint32
}

// Scorer scores pods through one kvmatch client (safe for concurrent use, as the client is).
type Scorer struct {
	Client *kvmatch.Client
	Pool   string // "" : the server's default pool
}

// Score returns a score per pod name and the decision they come from. The caller reports the
// decision's lifecycle (DISPATCHED, FIRST_TOKEN, FINISHED) by its DecisionID.
func (s *Scorer) Score(ctx context.Context, requestID string, tokens []uint32, pods []Pod) (map[string]float64, *kvmatch.Decision, error) {
	candidates := make([]uint32, len(pods))
	for i, p := range pods {
		candidates[i] = p.Worker
	}
	decisions, err := s.Client.Route(ctx, kvmatch.RouteRequest{RequestID: requestID, Pool: s.Pool,
		Tokens: tokens, Candidates: candidates})
	if err != nil {
		return nil, nil, err
	}
	d := &decisions[0]
	if err := d.Err(); err != nil {
		return nil, d, fmt.Errorf("kvmatch could not route %s: %w", requestID, err)
	}
	depth := make(map[uint32]uint32, len(d.Candidates))
	for _, row := range d.Candidates {
		depth[row.Worker] = row.Depth
	}
	scores := make(map[string]float64, len(pods))
	for _, p := range pods {
		switch {
		case p.Worker == d.ChosenWorker:
			scores[p.Name] = 1
		case d.NBlocks > 0:
			scores[p.Name] = 0.5 * float64(depth[p.Worker]) / float64(d.NBlocks)
		default:
			scores[p.Name] = 0
		}
	}
	return scores, d, nil
}

// SPDX-License-Identifier: Apache-2.0

package scorer

// The scorer against a real `kvmatch serve` ($KM_BIN, else build/kvmatch or build-cpu/kvmatch):
// the pod kvmatch chose scores 1, and a prompt routed twice is scored by the cache it left.

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	kvmatch "kvmatch/clients/go"
)

func serve(t *testing.T, ctx context.Context) *kvmatch.Client {
	bin := os.Getenv("KM_BIN")
	if bin == "" {
		bin = "../../../../build/kvmatch"
		if _, err := os.Stat(bin); err != nil {
			bin = "../../../../build-cpu/kvmatch"
		}
	}
	sock := filepath.Join(t.TempDir(), "kvmatch.sock")
	cmd := exec.Command(bin, "serve", "--socket", sock, "--records", "none", "--pool", "default:16:kv",
		"--worker", "default:0", "--worker", "default:1", "--worker", "default:2")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	for {
		c, err := kvmatch.Dial(ctx, "unix:"+sock)
		if err == nil {
			t.Cleanup(func() { c.Close() })
			return c
		}
		if ctx.Err() != nil {
			t.Fatalf("kvmatch serve did not accept: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestScoresFollowTheDecision(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s := &Scorer{Client: serve(t, ctx)}
	pods := []Pod{{"pod-a", 0}, {"pod-b", 1}, {"pod-c", 2}}
	tokens := make([]uint32, 64)
	for i := range tokens {
		tokens[i] = uint32(1000 + i)
	}
	scores, d, err := s.Score(ctx, "req-1", tokens, pods)
	if err != nil || len(scores) != 3 {
		t.Fatalf("%v %v", err, scores)
	}
	chosen := pods[d.ChosenWorker].Name
	if scores[chosen] != 1 {
		t.Fatalf("the chosen pod %s scores %v", chosen, scores)
	}
	// Only two pods left by the router's filters, the one that holds the prompt among them.
	other := pods[(d.ChosenWorker+1)%3]
	scores, d2, err := s.Score(ctx, "req-2", tokens, []Pod{pods[d.ChosenWorker], other})
	if err != nil || d2.OwnerWorker == nil || *d2.OwnerWorker != d.ChosenWorker || len(scores) != 2 {
		t.Fatalf("%v %+v", err, d2)
	}
	if scores[chosen] <= scores[other.Name] && d2.ChosenWorker == d.ChosenWorker {
		t.Fatalf("the pod holding the prompt scores no higher: %v", scores)
	}
	if _, _, err := s.Score(ctx, "req-3", tokens, []Pod{{"ghost", 40}}); err == nil {
		t.Fatal("a pod outside the pool: no error")
	}
}

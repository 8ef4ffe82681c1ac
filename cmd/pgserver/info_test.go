package main

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/gocomm/gocomm/node"
	"github.com/gocomm/gocomm/pg"
)

// TestProbeWithoutGPUEngine: a sidecar with no GPU engine reports what Info and Attach would:
// no CUDA (and why), the host engine, NCCL's sparse transport with its reason, the node's
// facts and the client's (its NCCL ignored: a client names none to such a sidecar), printed
// as `gocomm info` shows them.
func TestProbeWithoutGPUEngine(t *testing.T) {
	facts := []node.Fact{{Name: node.Host, Value: "h", Reason: "for people"}, {Name: node.GPUs, Value: "0", Reason: "none"}}
	srv := pg.NewServer(pg.Config{Version: "9.9", Node: facts}, nil, quiet())
	r, err := probe(srv, "/nowhere/libnccl.so.2")
	if err != nil {
		t.Fatal(err)
	}
	if r.Version != "9.9" || r.CUDAAvailable || r.CUDAError != "this sidecar has no GPU engine" || len(r.Devices) != 0 {
		t.Errorf("cuda: %+v", r)
	}
	if r.SparseTransport != [2]string{"nccl", "no GPU engine in this sidecar"} {
		t.Errorf("sparse transport %v", r.SparseTransport)
	}
	if e := r.Engines["host"]; e[0] != true {
		t.Errorf("engines %v", r.Engines)
	}
	if c := r.Capabilities[node.NCCL]; c[0] != node.No || !strings.Contains(c[1], "sent no path") {
		t.Errorf("nccl fact %v: the client's NCCL is not named to a sidecar without CUDA", c)
	}
	if r.Capabilities[node.Host] != [2]string{"h", "for people"} || r.Capabilities[node.NVSHMEM][0] != node.No {
		t.Errorf("capabilities %v", r.Capabilities)
	}
	var out bytes.Buffer
	r.print(&out, "/x/pgserver")
	for _, w := range []string{
		"pgserver 9.9 (/x/pgserver)\n", "CUDA: no (this sidecar has no GPU engine)\n", "engines:\n",
		"  host       yes  CPU tensors over TCP between sidecars\n", "capabilities:\n", "  host           h          for people\n",
	} {
		if !strings.Contains(out.String(), w) {
			t.Errorf("no %q in\n%s", w, out.String())
		}
	}
}

// TestInfoJSON: `pgserver info --json` on this machine (a GPU or none) names every fact a
// client is told at attach, the sparse transport and the all_reduce bound the route table
// takes.
func TestInfoJSON(t *testing.T) {
	var out bytes.Buffer
	if err := info([]string{"--json"}, &out); err != nil {
		t.Fatal(err)
	}
	var r map[string]any
	if err := json.Unmarshal(out.Bytes(), &r); err != nil {
		t.Fatalf("%v: %s", err, out.String())
	}
	caps, _ := r["capabilities"].(map[string]any)
	for _, f := range []string{node.Host, node.GPUs, node.NVLinkDomain, node.MPS, node.NCCL, node.NVSHMEM} {
		if c, _ := caps[f].([]any); len(c) != 2 || c[0] == "" || c[1] == "" {
			t.Errorf("fact %s: %v", f, caps[f])
		}
	}
	if st, _ := r["sparse_transport"].([]any); len(st) != 2 || (st[0] != "nccl" && st[0] != "nvshmem") {
		t.Errorf("sparse_transport %v", r["sparse_transport"])
	}
	if m, _ := r["ar_max"].(float64); m <= 0 {
		t.Errorf("ar_max %v", r["ar_max"])
	}
	// the printed report of this probe, for `gocomm info` to show without probing again
	if text, _ := r["text"].(string); !strings.Contains(text, "capabilities:\n") || !strings.Contains(text, "engines:\n") {
		t.Errorf("text %q", r["text"])
	}
}

// pgserver info: what a sidecar started here would tell its client (the Info rpc, and the
// facts and sparse transport Attach decides for a client naming its NCCL), without serving.
// `gocomm info` prints it beside the package's build record and the route table the compiled
// client makes of it (--json); a person can run it alone.

package main

import (
	"cmp"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"

	"github.com/gocomm/gocomm/config"
	"github.com/gocomm/gocomm/node"
	"github.com/gocomm/gocomm/pg"
)

// infoReport is the sidecar's part of `gocomm info --json` (its "sidecar" key), in the shape
// that command has always printed: engines and capabilities as {name: [value, reason]}.
type infoReport struct {
	Version         string               `json:"version"`
	CUDAAvailable   bool                 `json:"cuda_available"`
	CUDAError       string               `json:"cuda_error"`
	Devices         []string             `json:"devices"` // "index: name"
	Engines         map[string][2]any    `json:"engines"`
	Capabilities    map[string][2]string `json:"capabilities"`
	SparseTransport [2]string            `json:"sparse_transport"` // engine, why
	// ARMax is GOCOMM_AR_MAX as the sidecar reads it (ClientKnobs.ar_max at Attach): the
	// route table's in-process all_reduce bound.
	ARMax uint64 `json:"ar_max"`
	// Text is the report as `pgserver info` prints it, so `gocomm info` prints this very probe
	// beside the route table it makes of the rest.
	Text string `json:"text"`

	engines []pg.Engine // in the order the text prints them
	facts   []node.Fact
}

// info is `pgserver info [--json] [--nccl PATH]`.
func info(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("pgserver info", flag.ContinueOnError)
	asJSON := fs.Bool("json", false, "print JSON (the body of `gocomm info --json`'s \"sidecar\")")
	ncclPath := fs.String("nccl", "", "the libnccl a client would name at attach (its torch's): decides the nccl and nvshmem facts")
	if err := fs.Parse(args); err != nil {
		return err
	}
	cfg, _, err := config.FromEnv()
	if err != nil {
		return err
	}
	pcfg, err := engines(quiet(), cfg, options{})
	if err != nil {
		return err
	}
	r, err := probe(pg.NewServer(pcfg, nil, quiet()), *ncclPath)
	if err != nil {
		return err
	}
	r.ARMax = uint64(cfg.Client.AllReduce.Max)
	if *asJSON {
		var text strings.Builder
		r.print(&text, os.Args[0])
		r.Text = text.String()
		enc := json.NewEncoder(out)
		enc.SetIndent("", "  ")
		return enc.Encode(r)
	}
	r.print(out, os.Args[0])
	return nil
}

// probe asks srv what Info reports after a client naming ncclPath attached; without CUDA the
// client names none (the shim sends its NCCL only to a sidecar that can run CUDA ops).
func probe(srv *pg.Server, ncclPath string) (infoReport, error) {
	r := infoReport{Version: srv.Version(), CUDAError: "this sidecar has no GPU engine", Devices: []string{},
		Engines: map[string][2]any{}, Capabilities: map[string][2]string{}}
	if dev := srv.Device(); dev != nil {
		ok, detail, devices := dev.Info()
		r.CUDAAvailable, r.CUDAError = ok, ""
		if !ok {
			r.CUDAError = detail
		}
		for _, d := range devices {
			r.Devices = append(r.Devices, fmt.Sprintf("%d: %s", d.Index, d.Name))
		}
	}
	if !r.CUDAAvailable {
		ncclPath = ""
	}
	choice, err := srv.Probe(ncclPath)
	if err != nil {
		return r, err
	}
	r.SparseTransport = [2]string{cmp.Or(choice.Engine, "nccl"), choice.Reason}
	r.engines, r.facts = srv.Engines(), srv.Capabilities()
	for _, e := range r.engines {
		r.Engines[e.Name] = [2]any{e.Available, e.Detail}
	}
	for _, f := range r.facts {
		r.Capabilities[f.Name] = [2]string{f.Value, f.Reason}
	}
	return r, nil
}

// print writes the report as `gocomm info` shows it; exe is the path this pgserver ran as.
func (r infoReport) print(out io.Writer, exe string) {
	fmt.Fprintf(out, "pgserver %s (%s)\n", r.Version, exe)
	fmt.Fprintf(out, "CUDA: %s", yesNo(r.CUDAAvailable))
	if r.CUDAError != "" {
		fmt.Fprintf(out, " (%s)", r.CUDAError)
	}
	fmt.Fprintln(out)
	for _, d := range r.Devices {
		fmt.Fprintf(out, "  GPU %s\n", d)
	}
	fmt.Fprintln(out, "engines:")
	for _, e := range r.engines {
		fmt.Fprintf(out, "  %-10s %-4s %s\n", e.Name, yesNo(e.Available), e.Detail)
	}
	fmt.Fprintln(out, "capabilities:")
	for _, f := range r.facts {
		fmt.Fprintf(out, "  %-14s %-10s %s\n", f.Name, f.Value, f.Reason)
	}
}

// quiet is the log of a pgserver that serves no one: what it decides, it prints.
func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

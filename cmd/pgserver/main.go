// Command pgserver is gocomm's sidecar: one per rank, it runs that rank's collectives for
// the PyTorch process that started it. See serve.go for its flags and wiring.
package main

import (
	"errors"
	"fmt"
	"os"
)

func main() {
	if err := run(os.Args[1:]); errors.Is(err, errChecksFailed) {
		os.Exit(1) // pgserver doctor printed which
	} else if err != nil {
		fmt.Fprintln(os.Stderr, "pgserver:", err)
		os.Exit(1)
	}
}

// SPDX-License-Identifier: Apache-2.0

// The seed example: a sandbox runs Python, forks four copies, stops them all.
//
//	go run ./examples/seed            # a container (copies get its files)
//	go run ./examples/seed vm         # a QEMU VM (copies get its memory too)
//	go run ./examples/seed microvm    # a Firecracker microVM (hardware KVM needed)
package main

import (
	"context"
	"fmt"
	"log"
	"os"

	opendsec "github.com/opendsec/opendsec/sdk/go"
)

func main() {
	backend := "container"
	if len(os.Args) > 1 {
		backend = os.Args[1]
	}
	if err := run(context.Background(), backend); err != nil {
		log.Fatal(err)
	}
}

func run(ctx context.Context, backend string) error {
	client, err := opendsec.New()
	if err != nil {
		return err
	}
	sb, err := client.CreateSandbox(ctx, opendsec.RunArgs{Backend: backend, Image: "root/py:3.11",
		CPUCoresLimit: 1, MemoryLimitMB: 1024})
	if err != nil {
		return err
	}
	defer sb.Stop(ctx)
	r, err := sb.RunShell(ctx, "python3 -c 'print(6*7)'")
	if err != nil {
		return err
	}
	fmt.Print(r.Stdout)
	forks, err := sb.Fork(ctx, 4, nil)
	if err != nil {
		return err
	}
	for _, f := range forks {
		if err := f.Stop(ctx); err != nil {
			return err
		}
	}
	return nil
}

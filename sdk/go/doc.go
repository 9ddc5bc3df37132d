// SPDX-License-Identifier: Apache-2.0

// Package opendsec is the Go client of OpenDsec, self-hosted sandboxes for AI agents and
// reinforcement-learning rollouts: containers, QEMU VMs and Firecracker microVMs behind
// one API, with fork, pause/resume, snapshots, commit-to-image and deny-by-default egress.
//
// A Client finds its API the way the CLI and the Python SDK do: options, else
// DSEC_API_URL and DSEC_API_KEY, else the client.toml that `dsec up` writes.
//
//	c, err := opendsec.New()
//	sb, err := c.CreateSandbox(ctx, opendsec.RunArgs{Image: "root/py:3.11", MemoryLimitMB: 1024})
//	defer sb.Stop(ctx)
//	r, err := sb.RunShell(ctx, "python3 -c 'print(6*7)'")
//	fmt.Print(r.Stdout) // 42
//	forks, err := sb.Fork(ctx, 4, nil)
//
// Every call takes a context: its deadline and cancellation end the call (a call whose
// context has no deadline gets the client's timeout, longer for calls that wait for work
// such as Exec, Fork and Pause). Streams (ExecStream, Attach, Files.Open) last as long as
// their context.
//
// A failed call returns an *Error carrying the API's code, message and HTTP status;
// test it with errors.Is against ErrInvalidArgument (400), ErrUnauthenticated (401),
// ErrPermissionDenied (403), ErrNotFound (404), ErrAlreadyExists and
// ErrFailedPrecondition (409), ErrResourceExhausted (429, a quota or limit) and so on.
//
// The package uses the standard library only.
package opendsec

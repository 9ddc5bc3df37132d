// SPDX-License-Identifier: Apache-2.0

package opendsec

import (
	"context"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// Sandbox is one sandbox. Its methods send requests; Info is what the last answer said.
type Sandbox struct {
	c    *Client
	Info SandboxInfo
}

// ID is the sandbox's id.
func (s *Sandbox) ID() string { return s.Info.ID }

func (s *Sandbox) base() string { return "/v1/sandboxes/" + url.PathEscape(s.Info.ID) }

// Files reaches the sandbox's files.
func (s *Sandbox) Files() *Files { return &Files{sb: s} }

// Sessions reaches the sandbox's persistent shells.
func (s *Sandbox) Sessions() *Sessions { return &Sessions{sb: s} }

// PtySize is a terminal's size.
type PtySize struct {
	Cols int `json:"cols"`
	Rows int `json:"rows"`
}

// ExecOptions is a command to run: Argv (a program and its arguments) or Cmd (a shell
// command line, run by /bin/sh -c), exactly one of them.
type ExecOptions struct {
	Argv []string
	Cmd  string
	Env  map[string]string
	Cwd  string
	// User is a name from the sandbox's /etc/passwd or a numeric uid (default root).
	User string
	// Timeout ends the command (exit code 124-like, TimedOut set); 0: the server's default.
	Timeout time.Duration
	// Stdin is written to the command's stdin, which is then closed.
	Stdin string
	// Pty gives the process a terminal (ExecStream and ExecBackground only): its output
	// all arrives as stdout.
	Pty *PtySize
	// Tag is a free string shown in the process list.
	Tag string
}

type execBody struct {
	Cmd        string            `json:"cmd,omitempty"`
	Argv       []string          `json:"argv,omitempty"`
	Env        map[string]string `json:"env,omitempty"`
	Cwd        string            `json:"cwd,omitempty"`
	Timeout    float64           `json:"timeout_seconds,omitempty"`
	Stdin      *string           `json:"stdin,omitempty"`
	User       string            `json:"user,omitempty"`
	Stream     bool              `json:"stream,omitempty"`
	Background bool              `json:"background,omitempty"`
	Pty        *PtySize          `json:"pty,omitempty"`
	Tag        string            `json:"tag,omitempty"`
}

func (o *ExecOptions) body() (*execBody, error) {
	if (o.Argv == nil) == (o.Cmd == "") {
		return nil, &Error{Code: "invalid_argument", Status: 400,
			Message: "exec needs exactly one of Argv (a program and its arguments) and Cmd (a shell command line)"}
	}
	b := &execBody{Cmd: o.Cmd, Argv: o.Argv, Env: o.Env, Cwd: o.Cwd, User: o.User,
		Timeout: o.Timeout.Seconds(), Pty: o.Pty, Tag: o.Tag}
	if o.Stdin != "" {
		stdin := o.Stdin
		b.Stdin = &stdin
	}
	return b, nil
}

// How much longer than a command's own timeout an exec call waits for the answer.
const execSlack = 60 * time.Second

func (o *ExecOptions) wait() time.Duration {
	if o.Timeout > 0 {
		return o.Timeout + execSlack
	}
	return 10*time.Minute + execSlack
}

// Exec runs a command and waits for it. A command that fails is not an error: see the
// result's ExitCode.
func (s *Sandbox) Exec(ctx context.Context, o ExecOptions) (*ExecResult, error) {
	if o.Pty != nil {
		return nil, &Error{Code: "invalid_argument", Status: 400, Message: "a terminal (Pty) needs ExecStream or ExecBackground"}
	}
	b, err := o.body()
	if err != nil {
		return nil, err
	}
	var r ExecResult
	if err := s.c.call(ctx, "POST", s.base()+"/exec", nil, b, &r, o.wait()); err != nil {
		return nil, err
	}
	return &r, nil
}

// RunShell runs command with /bin/sh -c and waits for it.
func (s *Sandbox) RunShell(ctx context.Context, command string) (*ExecResult, error) {
	return s.Exec(ctx, ExecOptions{Cmd: command})
}

// ExecStream starts a process and returns once it runs (Pid set); read its output with
// Next or Wait. ctx bounds the reading: cancelling it closes the stream, and the process
// goes on (Attach reads it again). Stdin stays open for SendStdin unless o.Stdin is set.
func (s *Sandbox) ExecStream(ctx context.Context, o ExecOptions) (*Process, error) {
	b, err := o.body()
	if err != nil {
		return nil, err
	}
	b.Stream = true
	resp, err := s.c.send(ctx, "POST", s.base()+"/exec", nil, jsonReader(b), "application/json", -1)
	if err != nil {
		return nil, err
	}
	p := newProcess(ctx, s, 0, resp.Body)
	if err := p.waitStarted(); err != nil {
		p.Close()
		return nil, err
	}
	return p, nil
}

// ExecBackground starts a process that runs on its own and returns at once; reading the
// returned Process attaches to it (kept output first, then live output).
func (s *Sandbox) ExecBackground(ctx context.Context, o ExecOptions) (*Process, error) {
	b, err := o.body()
	if err != nil {
		return nil, err
	}
	b.Background = true
	var r struct {
		Pid int `json:"pid"`
	}
	if err := s.c.call(ctx, "POST", s.base()+"/exec", nil, b, &r, 0); err != nil {
		return nil, err
	}
	return &Process{sb: s, Pid: r.Pid}, nil
}

// Attach reads a process started by ExecStream or ExecBackground, from this client or
// another: its kept output, then live output, then its exit. ErrNotFound for an
// unknown pid. ctx bounds the reading as for ExecStream.
func (s *Sandbox) Attach(ctx context.Context, pid int) (*Process, error) {
	p := &Process{sb: s, Pid: pid}
	if err := p.attach(ctx); err != nil {
		return nil, err
	}
	return p, nil
}

// Processes lists the managed processes: running ones and the last finished ones.
func (s *Sandbox) Processes(ctx context.Context) ([]ProcessInfo, error) {
	var r struct {
		Processes []ProcessInfo `json:"processes"`
	}
	err := s.c.call(ctx, "GET", s.base()+"/processes", nil, nil, &r, 0)
	return r.Processes, err
}

// Refresh reads the sandbox's info again.
func (s *Sandbox) Refresh(ctx context.Context) (*SandboxInfo, error) {
	return s.info(ctx, "GET", "", nil, 0)
}

func (s *Sandbox) info(ctx context.Context, method, path string, body any, wait time.Duration) (*SandboxInfo, error) {
	var info SandboxInfo
	if err := s.c.call(ctx, method, s.base()+path, nil, body, &info, wait); err != nil {
		return nil, err
	}
	s.Info = info
	return &s.Info, nil
}

// ForkOptions are Fork's optional settings.
type ForkOptions struct {
	// Labels are set on the copies over the source's.
	Labels map[string]string `json:"labels,omitempty"`
	// Edge makes the copies on that edge (a cluster; VM sandboxes).
	Edge string `json:"edge,omitempty"`
}

// Fork makes count copies of the sandbox. A VM sandbox's copies carry its memory: their
// processes go on from where the source was. A container's copies get its files; their
// processes start afresh.
func (s *Sandbox) Fork(ctx context.Context, count int, o *ForkOptions) ([]*Sandbox, error) {
	body := struct {
		Count int `json:"count"`
		ForkOptions
	}{Count: count}
	if o != nil {
		body.ForkOptions = *o
	}
	var r struct {
		Sandboxes []SandboxInfo `json:"sandboxes"`
	}
	if err := s.c.call(ctx, "POST", s.base()+"/fork", nil, body, &r, 10*time.Minute); err != nil {
		return nil, err
	}
	return s.c.sandboxes(r.Sandboxes), nil
}

// Pause stops the sandbox's processes where they are and its TTL. With toDisk its
// processes end instead, freeing the host's memory until Resume (a VM's memory is kept
// on disk; a container starts afresh on resume).
func (s *Sandbox) Pause(ctx context.Context, toDisk bool) (*SandboxInfo, error) {
	return s.info(ctx, "POST", "/pause", map[string]bool{"to_disk": toDisk}, 10*time.Minute)
}

// Resume resumes a paused sandbox where it stopped.
func (s *Sandbox) Resume(ctx context.Context) (*SandboxInfo, error) {
	return s.info(ctx, "POST", "/resume", struct{}{}, 15*time.Minute)
}

// SetTimeout sets the sandbox's remaining lifetime to ttl from now.
func (s *Sandbox) SetTimeout(ctx context.Context, ttl time.Duration) (*SandboxInfo, error) {
	return s.info(ctx, "POST", "/timeout", map[string]int64{"ttl_seconds": int64(ttl / time.Second)}, 0)
}

// SetNetworkRules replaces what the sandbox may reach (keys as RunArgs.NetworkRules) and
// the headers set on its requests (nil: none); an empty map closes egress. New
// connections follow the new rules at once.
func (s *Sandbox) SetNetworkRules(ctx context.Context, rules map[string]bool, egressHeaders map[string]map[string]string) (*SandboxInfo, error) {
	if rules == nil {
		rules = map[string]bool{}
	}
	body := struct {
		Rules   map[string]bool              `json:"network_rules"`
		Headers map[string]map[string]string `json:"egress_headers,omitempty"`
	}{rules, egressHeaders}
	return s.info(ctx, "PUT", "/network", body, 0)
}

// Snapshot keeps the sandbox's state under a new id (it pauses briefly), with labels
// over the sandbox's; start sandboxes from it with Client.RestoreSnapshot.
func (s *Sandbox) Snapshot(ctx context.Context, labels map[string]string) (*SnapshotInfo, error) {
	var body any = struct{}{}
	if len(labels) > 0 {
		body = map[string]any{"labels": labels}
	}
	var r SnapshotInfo
	if err := s.c.call(ctx, "POST", s.base()+"/snapshot", nil, body, &r, 15*time.Minute); err != nil {
		return nil, err
	}
	return &r, nil
}

// Commit turns the sandbox's filesystem changes into a new image (a reference in the
// key's project, e.g. "root/t1/env:v1"). An existing image is replaced only with
// overwrite; otherwise ErrAlreadyExists.
func (s *Sandbox) Commit(ctx context.Context, image string, overwrite bool) (*CommitResult, error) {
	body := map[string]any{"image": image, "overwrite": overwrite}
	var r CommitResult
	if err := s.c.call(ctx, "POST", s.base()+"/commit", nil, body, &r, 30*time.Minute); err != nil {
		return nil, err
	}
	return &r, nil
}

// Metrics is what the running sandbox uses now: cpu_used_ns, memory_used_bytes,
// memory_limit_bytes, disk_used_bytes and more.
func (s *Sandbox) Metrics(ctx context.Context) (map[string]any, error) {
	var r map[string]any
	err := s.c.call(ctx, "GET", s.base()+"/metrics", nil, nil, &r, 0)
	return r, err
}

// PortURL is the URL of port inside the sandbox through the API (HTTP and WebSocket),
// carrying the sandbox's port token so that it opens without an API key.
func (s *Sandbox) PortURL(port int, path string) string {
	u := fmt.Sprintf("%s%s/ports/%s/%s", s.c.apiURL, s.base(), strconv.Itoa(port), strings.TrimLeft(path, "/"))
	if s.Info.PortToken != "" {
		sep := "?"
		if strings.Contains(u, "?") {
			sep = "&"
		}
		u += sep + "dsec_token=" + url.QueryEscape(s.Info.PortToken)
	}
	return u
}

// Stop stops the sandbox; stopping one that is already gone is not an error.
func (s *Sandbox) Stop(ctx context.Context) error {
	err := s.c.call(ctx, "DELETE", s.base(), nil, nil, nil, 0)
	if err != nil && isCode(err, "not_found") {
		return nil
	}
	return err
}

func isCode(err error, code string) bool {
	e, ok := err.(*Error)
	return ok && e.Code == code
}

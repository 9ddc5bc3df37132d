// SPDX-License-Identifier: Apache-2.0

package opendsec_test

// Tests against a running OpenDsec API (`dsec up`), found as New finds it, when
// DSEC_GO_E2E=1: they create sandboxes, a project, keys and an image there, so they never
// run against a configured API unasked. The project's end-to-end suite sets it, with its
// own node and the images root/base and root/py:3.11.

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	opendsec "github.com/opendsec/opendsec/sdk/go"
)

func liveClient(t *testing.T) *opendsec.Client {
	t.Helper()
	if os.Getenv("DSEC_GO_E2E") != "1" {
		t.Skip("set DSEC_GO_E2E=1 to run against the configured API (it creates sandboxes, a project and keys there)")
	}
	c, err := opendsec.New()
	if err == nil {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err = c.Whoami(ctx)
	}
	if err != nil {
		t.Fatalf("no OpenDsec API to test against (%v); run `dsec up`", err)
	}
	return c
}

func create(t *testing.T, c *opendsec.Client, args opendsec.RunArgs) *opendsec.Sandbox {
	t.Helper()
	if args.Image == "" {
		args.Image = "root/base"
	}
	if args.TTLSeconds == 0 {
		args.TTLSeconds = 600
	}
	if args.Labels == nil {
		args.Labels = map[string]string{}
	}
	args.Labels["go-sdk-test"] = t.Name()
	sb, err := c.CreateSandbox(context.Background(), args)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	t.Cleanup(func() { _ = sb.Stop(context.Background()) })
	return sb
}

func mine(t *testing.T, c *opendsec.Client) []opendsec.SandboxInfo {
	t.Helper()
	l, err := c.ListSandboxes(context.Background(), map[string]string{"go-sdk-test": t.Name()})
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// The seed's example, written in Go, run as a program: 6*7 in Python, a fork of 4, all
// stopped.
func TestSeedExample(t *testing.T) {
	c := liveClient(t)
	ctx := context.Background()
	before, err := c.ListSandboxes(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), "seed")
	if out, err := exec.Command("go", "build", "-o", bin, "./examples/seed").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	var stdout, stderr bytes.Buffer
	cmd := exec.Command(bin)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("the seed example failed: %v\n%s", err, stderr.String())
	}
	if stdout.String() != "42\n" {
		t.Fatalf("the seed example printed %q", stdout.String())
	}
	after, err := c.ListSandboxes(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(after) != len(before) {
		t.Fatalf("the example left sandboxes: %d before, %d after", len(before), len(after))
	}
}

func TestExecStreamsOutputWhileTheProcessRuns(t *testing.T) {
	c := liveClient(t)
	ctx := context.Background()
	sb := create(t, c, opendsec.RunArgs{MemoryLimitMB: 64})
	r, err := sb.Exec(ctx, opendsec.ExecOptions{Argv: []string{"sh", "-c", "echo $X; echo e >&2; exit 3"},
		Env: map[string]string{"X": "x1"}})
	if err != nil {
		t.Fatal(err)
	}
	if r.Stdout != "x1\n" || r.Stderr != "e\n" || r.ExitCode != 3 {
		t.Fatalf("exec: %+v", r)
	}
	// The first line arrives while the process still waits for its stdin.
	p, err := sb.ExecStream(ctx, opendsec.ExecOptions{Cmd: "echo first; read line; echo got:$line; echo bye >&2; exit 5"})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if p.Pid <= 1 {
		t.Fatalf("pid %d", p.Pid)
	}
	ch, err := p.Next()
	if err != nil || ch.Stream != "stdout" || string(ch.Data) != "first\n" {
		t.Fatalf("first chunk %q %q %v", ch.Stream, ch.Data, err)
	}
	procs, err := sb.Processes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	running := false
	for _, pi := range procs {
		running = running || (pi.Pid == p.Pid && pi.Running)
	}
	if !running {
		t.Fatalf("process %d is not running after its first line: %+v", p.Pid, procs)
	}
	if err := p.SendStdin(ctx, []byte("hello\n"), true); err != nil {
		t.Fatal(err)
	}
	res, err := p.Wait()
	if err != nil {
		t.Fatal(err)
	}
	if res.Stdout != "first\ngot:hello\n" || res.Stderr != "bye\n" || res.ExitCode != 5 {
		t.Fatalf("result %+v", res)
	}
	// A background process is attached to later, and signalled.
	bg, err := sb.ExecBackground(ctx, opendsec.ExecOptions{Cmd: "echo up; sleep 300", Tag: "go"})
	if err != nil {
		t.Fatal(err)
	}
	at, err := sb.Attach(ctx, bg.Pid)
	if err != nil {
		t.Fatal(err)
	}
	if ch, err := at.Next(); err != nil || string(ch.Data) != "up\n" {
		t.Fatalf("attached: %q %v", ch.Data, err)
	}
	if err := at.Signal(ctx, "TERM"); err != nil {
		t.Fatal(err)
	}
	res, err = at.Wait()
	if err != nil {
		t.Fatal(err)
	}
	if res.ExitCode != 128+15 {
		t.Fatalf("after SIGTERM: %+v", res)
	}
	if _, err := sb.Attach(ctx, 999999); !errors.Is(err, opendsec.ErrNotFound) {
		t.Fatalf("attach to no process: %v", err)
	}
}

// seeded is n bytes of a fixed pseudo-random sequence, made as they are read.
func seeded(n int64) io.Reader { return io.LimitReader(rand.New(rand.NewSource(42)), n) }

func TestA100MiBFileGoesInAndOutWhole(t *testing.T) {
	c := liveClient(t)
	ctx := context.Background()
	sb := create(t, c, opendsec.RunArgs{MemoryLimitMB: 128, DiskLimitMB: 1024})
	const size = 100 << 20
	up := sha256.New()
	w, err := sb.Files().Write(ctx, "/root/big.bin", io.TeeReader(seeded(size), up), &opendsec.WriteOptions{Size: size})
	if err != nil {
		t.Fatal(err)
	}
	if w.Size != size {
		t.Fatalf("wrote %d bytes", w.Size)
	}
	want := hex.EncodeToString(up.Sum(nil))
	// The sandbox sees the same bytes.
	r, err := sb.RunShell(ctx, "sha256sum /root/big.bin")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(r.Stdout, want+" ") {
		t.Fatalf("in the sandbox: %q, sent %s", r.Stdout, want)
	}
	// And so does a streamed download.
	rc, err := sb.Files().Open(ctx, "/root/big.bin")
	if err != nil {
		t.Fatal(err)
	}
	down := sha256.New()
	n, err := io.Copy(down, rc)
	rc.Close()
	if err != nil || n != size {
		t.Fatalf("downloaded %d bytes: %v", n, err)
	}
	if got := hex.EncodeToString(down.Sum(nil)); got != want {
		t.Fatalf("downloaded %s, sent %s", got, want)
	}
	st, err := sb.Files().Stat(ctx, "/root/big.bin")
	if err != nil || st.Size != size || st.Type != "file" {
		t.Fatalf("stat %+v %v", st, err)
	}
	if _, err := sb.Files().Read(ctx, "/root/none"); !errors.Is(err, opendsec.ErrNotFound) {
		t.Fatalf("a missing file: %v", err)
	}
	if _, err := sb.Files().Read(ctx, "/root"); !errors.Is(err, opendsec.ErrInvalidArgument) {
		t.Fatalf("a directory read as a file: %v", err)
	}
}

func TestErrorsAreTyped(t *testing.T) {
	c := liveClient(t)
	ctx := context.Background()
	var e *opendsec.Error
	// 400: a request the server refuses, with a sentence that says what to fix.
	_, err := c.CreateSandbox(ctx, opendsec.RunArgs{Image: "root/base", MemoryLimitMB: -5})
	if !errors.Is(err, opendsec.ErrInvalidArgument) || !errors.As(err, &e) || e.Status != 400 || e.Message == "" {
		t.Fatalf("a negative memory limit: %#v", err)
	}
	// 401: a key the server does not know.
	bad, err := opendsec.New(opendsec.WithAPIURL(c.APIURL()), opendsec.WithAPIKey("dsk.not-a-key"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bad.ListSandboxes(ctx, nil); !errors.Is(err, opendsec.ErrUnauthenticated) || !errors.As(err, &e) || e.Status != 401 {
		t.Fatalf("a bad key: %#v", err)
	}
	// 404: a sandbox that does not exist.
	if _, err := c.GetSandbox(ctx, "nowhere-000000000000"); !errors.Is(err, opendsec.ErrNotFound) || !errors.As(err, &e) || e.Status != 404 {
		t.Fatalf("no such sandbox: %#v", err)
	}
	// 429: a project's quota of one sandbox, used up.
	project := fmt.Sprintf("root/go-sdk-%d", time.Now().UnixNano())
	if _, err := c.CreateProject(ctx, project, opendsec.Quota{Sandboxes: opendsec.Int64(1)}); err != nil {
		t.Fatal(err)
	}
	k, err := c.CreateKey(ctx, "go-sdk-test", &opendsec.KeyOptions{Project: project, Agent: true})
	if err != nil || k.Secret == "" || k.ID == "" {
		t.Fatalf("key %+v %v", k, err)
	}
	defer c.RevokeKey(ctx, k.ID)
	tc, err := opendsec.New(opendsec.WithAPIURL(c.APIURL()), opendsec.WithAPIKey(k.Secret))
	if err != nil {
		t.Fatal(err)
	}
	one := create(t, tc, opendsec.RunArgs{MemoryLimitMB: 32})
	// Its own cleanup uses the tenant's key, which is revoked below: the admin's stops it.
	t.Cleanup(func() { _ = c.Sandbox(one.ID()).Stop(context.Background()) })
	if one.Info.Project != project {
		t.Fatalf("the sandbox counts against %q", one.Info.Project)
	}
	_, err = tc.CreateSandbox(ctx, opendsec.RunArgs{Image: "root/base", MemoryLimitMB: 32, TTLSeconds: 60})
	if !errors.Is(err, opendsec.ErrResourceExhausted) || !errors.As(err, &e) || e.Status != 429 {
		t.Fatalf("over quota: %#v", err)
	}
	// The project's key sees its own sandbox only; the admin's stay hidden from it.
	if _, err := tc.GetSandbox(ctx, one.ID()); err != nil {
		t.Fatal(err)
	}
	other := create(t, c, opendsec.RunArgs{MemoryLimitMB: 32})
	if _, err := tc.GetSandbox(ctx, other.ID()); !errors.Is(err, opendsec.ErrNotFound) {
		t.Fatalf("another project's sandbox: %v", err)
	}
	// A revoked key is refused.
	if err := c.RevokeKey(ctx, k.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := tc.ListSandboxes(ctx, nil); !errors.Is(err, opendsec.ErrUnauthenticated) {
		t.Fatalf("a revoked key: %v", err)
	}
}

func TestLifecycleSessionsSnapshotsAndImages(t *testing.T) {
	c := liveClient(t)
	ctx := context.Background()
	sb := create(t, c, opendsec.RunArgs{MemoryLimitMB: 64, NetworkRules: map[string]bool{"pypi": true}})
	if sb.Info.State != "running" || sb.Info.Limits.MemoryMB != 64 || !sb.Info.Network.Rules["pypi"] {
		t.Fatalf("info %+v", sb.Info)
	}
	if _, err := sb.Files().WriteFile(ctx, "/root/state.txt", []byte("v1"), nil); err != nil {
		t.Fatal(err)
	}
	// Sessions keep the shell's state.
	s, err := sb.Sessions().Create(ctx, &opendsec.SessionOptions{Cwd: "/root"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Run(ctx, "cd /tmp && export Y=7", 0); err != nil {
		t.Fatal(err)
	}
	r, err := s.Run(ctx, "echo $Y $(pwd)", 0)
	if err != nil || r.Stdout != "7 /tmp\n" || !r.Done() {
		t.Fatalf("session: %+v %v", r, err)
	}
	if err := s.Kill(ctx); err != nil {
		t.Fatal(err)
	}
	// Pause stops the clock of its processes; resume goes on.
	info, err := sb.Pause(ctx, false)
	if err != nil || info.State != "paused" {
		t.Fatalf("pause: %+v %v", info, err)
	}
	if _, err := sb.RunShell(ctx, "true"); !errors.Is(err, opendsec.ErrFailedPrecondition) {
		t.Fatalf("exec in a paused sandbox: %v", err)
	}
	if info, err = sb.Resume(ctx); err != nil || info.State != "running" {
		t.Fatalf("resume: %+v %v", info, err)
	}
	// Network rules are replaced.
	if info, err = sb.SetNetworkRules(ctx, map[string]bool{"npm": true}, nil); err != nil || info.Network.Rules["pypi"] || !info.Network.Rules["npm"] {
		t.Fatalf("rules: %+v %v", info, err)
	}
	// A snapshot starts new sandboxes with the files.
	snap, err := sb.Snapshot(ctx, map[string]string{"go-sdk-test": t.Name()})
	if err != nil {
		t.Fatal(err)
	}
	defer c.DeleteSnapshot(ctx, snap.ID)
	restored, err := c.RestoreSnapshot(ctx, snap.ID, 2, nil)
	if err != nil || len(restored) != 2 {
		t.Fatalf("restore: %d %v", len(restored), err)
	}
	for _, r := range restored {
		b, err := r.Files().Read(ctx, "/root/state.txt")
		_ = r.Stop(ctx)
		if err != nil || string(b) != "v1" {
			t.Fatalf("restored file %q %v", b, err)
		}
	}
	// Commit makes an image new sandboxes start from.
	image := fmt.Sprintf("root/go-sdk-commit:t%d", time.Now().UnixNano())
	cr, err := sb.Commit(ctx, image, false)
	if err != nil || len(cr.Digest) < 64 || len(cr.Layers) == 0 {
		t.Fatalf("commit: %+v %v", cr, err)
	}
	defer c.RemoveImage(ctx, cr.Image)
	if _, err := sb.Commit(ctx, image, false); !errors.Is(err, opendsec.ErrAlreadyExists) {
		t.Fatalf("a second commit to the same image: %v", err)
	}
	child := create(t, c, opendsec.RunArgs{Image: cr.Image, MemoryLimitMB: 32})
	if b, err := child.Files().Read(ctx, "/root/state.txt"); err != nil || string(b) != "v1" {
		t.Fatalf("committed file %q %v", b, err)
	}
	if err := sb.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := c.GetSandbox(ctx, sb.ID()); !errors.Is(err, opendsec.ErrNotFound) {
		t.Fatalf("a stopped sandbox: %v", err)
	}
	if err := child.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if left := mine(t, c); len(left) != 0 {
		t.Fatalf("left running: %+v", left)
	}
	// The node recorded what happened to it, in order.
	evs, _, err := c.Events(ctx, opendsec.EventsQuery{Sandbox: sb.ID(), Limit: 1000})
	if err != nil {
		t.Fatal(err)
	}
	var kinds []string
	for _, e := range evs {
		kinds = append(kinds, e.Type)
	}
	if got := strings.Join(kinds, ","); got != "created,paused,resumed,updated,snapshotted,stopped" {
		t.Fatalf("events of %s: %s", sb.ID(), got)
	}
}

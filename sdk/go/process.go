// SPDX-License-Identifier: Apache-2.0

package opendsec

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"sync"
)

// Chunk is a piece of a process's output: Stream is "stdout" or "stderr".
type Chunk struct {
	Stream string
	Data   []byte
}

// keepOutput is how much of each stream Wait returns: the server's default
// max_output_bytes, so waiting on a stream matches a plain Exec.
const keepOutput = 16 << 20

// maxEventLine bounds one NDJSON event (base64 output comes in chunks far smaller).
const maxEventLine = 64 << 20

// Process is a process started with ExecStream or ExecBackground, or found with Attach.
// Next returns its output as it comes and io.EOF after its exit; Wait reads the rest and
// returns the result. Close stops reading; the process goes on. One reader at a time.
type Process struct {
	sb *Sandbox
	// Pid is the process's id inside the sandbox.
	Pid int

	ctx     context.Context
	mu      sync.Mutex // held by the reader (Next, Wait)
	bodyMu  sync.Mutex // guards body, which Close may close while a read waits
	body    io.ReadCloser
	lines   *bufio.Reader
	pending []Chunk
	out     [2]bytes.Buffer
	dropped [2]bool
	result  *ExecResult
}

func newProcess(ctx context.Context, sb *Sandbox, pid int, body io.ReadCloser) *Process {
	return &Process{sb: sb, Pid: pid, ctx: ctx, body: body, lines: bufio.NewReaderSize(body, 64<<10)}
}

func (p *Process) path() string { return fmt.Sprintf("%s/processes/%d", p.sb.base(), p.Pid) }

func (p *Process) attach(ctx context.Context) error {
	resp, err := p.sb.c.send(ctx, "GET", p.path()+"/output", nil, nil, "", -1)
	if err != nil {
		return err
	}
	p.ctx, p.lines = ctx, bufio.NewReaderSize(resp.Body, 64<<10)
	p.bodyMu.Lock()
	p.body = resp.Body
	p.bodyMu.Unlock()
	return nil
}

type event struct {
	Type            string `json:"type"`
	Pid             int    `json:"pid"`
	Data            []byte `json:"data"` // base64 in the JSON
	ExitCode        int    `json:"exit_code"`
	Signal          *int   `json:"signal"`
	TimedOut        bool   `json:"timed_out"`
	OOMKilled       bool   `json:"oom_killed"`
	StdoutTruncated bool   `json:"stdout_truncated"`
	StderrTruncated bool   `json:"stderr_truncated"`
	DurationMs      uint64 `json:"duration_ms"`
	Code            string `json:"code"`
	Message         string `json:"message"`
}

// nextEvent reads one NDJSON event; io.EOF when the stream ends.
func (p *Process) nextEvent() (*event, error) {
	for {
		line, err := p.lines.ReadSlice('\n')
		if errors.Is(err, bufio.ErrBufferFull) {
			// A long line: gather it whole, bounded.
			buf := append([]byte(nil), line...)
			for errors.Is(err, bufio.ErrBufferFull) && len(buf) <= maxEventLine {
				line, err = p.lines.ReadSlice('\n')
				buf = append(buf, line...)
			}
			if len(buf) > maxEventLine {
				return nil, &Error{Code: "internal", Message: "an event of the output stream is over 64 MiB"}
			}
			line = buf
		}
		if err != nil && !(errors.Is(err, io.EOF) && len(bytes.TrimSpace(line)) > 0) {
			if errors.Is(err, io.EOF) {
				return nil, io.EOF
			}
			return nil, transportError(p.ctx, fmt.Sprintf("reading the output of process %d", p.Pid), err)
		}
		line = bytes.TrimSpace(line)
		if len(line) == 0 {
			continue
		}
		var ev event
		if err := json.Unmarshal(line, &ev); err != nil {
			return nil, &Error{Code: "internal", Message: fmt.Sprintf("an event of the output stream is not JSON: %v", err)}
		}
		return &ev, nil
	}
}

// read returns the next chunk; with untilStart also a {"start"} chunk. io.EOF once the
// process exited (result set).
func (p *Process) read(untilStart bool) (Chunk, error) {
	if p.result != nil {
		return Chunk{}, io.EOF
	}
	if p.lines == nil {
		ctx := p.ctx
		if ctx == nil {
			ctx = context.Background()
		}
		if err := p.attach(ctx); err != nil {
			return Chunk{}, err
		}
	}
	for {
		ev, err := p.nextEvent()
		if errors.Is(err, io.EOF) {
			p.closeBody()
			return Chunk{}, &Error{Code: "unavailable", Status: 503,
				Message: fmt.Sprintf("the output stream of process %d ended before its exit", p.Pid)}
		}
		if err != nil {
			p.closeBody()
			return Chunk{}, err
		}
		switch ev.Type {
		case "start":
			p.Pid = ev.Pid
			if untilStart {
				return Chunk{Stream: "start"}, nil
			}
		case "stdout", "stderr":
			p.keep(ev.Type, ev.Data)
			return Chunk{Stream: ev.Type, Data: ev.Data}, nil
		case "exit":
			p.finish(ev)
			p.closeBody()
			return Chunk{}, io.EOF
		case "error":
			p.closeBody()
			return Chunk{}, errorFromEvent(ev.Code, ev.Message)
		}
		// Other event kinds are skipped: newer servers may add some.
	}
}

func (p *Process) waitStarted() error {
	for p.Pid == 0 {
		c, err := p.read(true)
		if errors.Is(err, io.EOF) {
			return nil // it exited before it said it started
		}
		if err != nil {
			return err
		}
		if c.Stream != "start" {
			p.pending = append(p.pending, c)
		}
	}
	return nil
}

func streamIndex(s string) int {
	if s == "stderr" {
		return 1
	}
	return 0
}

func (p *Process) keep(stream string, data []byte) {
	i := streamIndex(stream)
	b := &p.out[i]
	b.Write(data)
	if b.Len() > 2*keepOutput {
		tail := append([]byte(nil), b.Bytes()[b.Len()-keepOutput:]...)
		b.Reset()
		b.Write(tail)
		p.dropped[i] = true
	}
}

func (p *Process) finish(ev *event) {
	var text [2]string
	for i := range p.out {
		b := p.out[i].Bytes()
		if len(b) > keepOutput {
			b = b[len(b)-keepOutput:]
			p.dropped[i] = true
		}
		text[i] = strings.ToValidUTF8(string(b), "\uFFFD")
		p.out[i].Reset()
	}
	p.result = &ExecResult{
		Stdout: text[0], Stderr: text[1], ExitCode: ev.ExitCode, Signal: ev.Signal,
		TimedOut: ev.TimedOut, OOMKilled: ev.OOMKilled,
		StdoutTruncated: ev.StdoutTruncated || p.dropped[0],
		StderrTruncated: ev.StderrTruncated || p.dropped[1],
		DurationMs:      ev.DurationMs,
	}
}

// Next returns the next output chunk as it comes, and io.EOF after the process exited
// (then Result is set). An error event of the stream comes back as an *Error.
func (p *Process) Next() (Chunk, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.pending) > 0 {
		c := p.pending[0]
		p.pending = p.pending[1:]
		return c, nil
	}
	return p.read(false)
}

// Wait reads the output to the end and returns the result; its Stdout and Stderr hold
// everything this Process read (the last 16 MiB of each).
func (p *Process) Wait() (*ExecResult, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.pending = nil // already kept
	for {
		_, err := p.read(false)
		if errors.Is(err, io.EOF) {
			return p.result, nil
		}
		if err != nil {
			return nil, err
		}
	}
}

// Result is the process's result once Next returned io.EOF or Wait returned (else nil).
func (p *Process) Result() *ExecResult {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.result
}

// SendStdin writes data to the process's stdin (its terminal for a PTY process); with
// closeAfter, stdin is closed after it.
func (p *Process) SendStdin(ctx context.Context, data []byte, closeAfter bool) error {
	var q map[string][]string
	if closeAfter {
		q = map[string][]string{"close": {"true"}}
	}
	resp, err := p.sb.c.send(ctx, "POST", p.path()+"/stdin", q, bytes.NewReader(data),
		"application/octet-stream", int64(len(data)))
	if err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.Body.Close()
}

// CloseStdin closes the process's stdin.
func (p *Process) CloseStdin(ctx context.Context) error { return p.SendStdin(ctx, nil, true) }

// Signal sends a signal to the process's group: a name ("SIGTERM" or "TERM") or a
// number ("9").
func (p *Process) Signal(ctx context.Context, sig string) error {
	var v any
	if n, err := strconv.Atoi(sig); err == nil {
		v = n
	} else {
		s := strings.ToUpper(strings.TrimSpace(sig))
		if !strings.HasPrefix(s, "SIG") {
			s = "SIG" + s
		}
		v = s
	}
	return p.sb.c.call(ctx, "POST", p.path()+"/signal", nil, map[string]any{"signal": v}, nil, 0)
}

// Kill sends SIGKILL.
func (p *Process) Kill(ctx context.Context) error { return p.Signal(ctx, "9") }

// Resize resizes a PTY process's terminal.
func (p *Process) Resize(ctx context.Context, cols, rows int) error {
	return p.sb.c.call(ctx, "POST", p.path()+"/resize", nil, PtySize{Cols: cols, Rows: rows}, nil, 0)
}

// Close stops reading the output; the process goes on.
func (p *Process) Close() error {
	p.closeBody()
	return nil
}

func (p *Process) closeBody() {
	p.bodyMu.Lock()
	b := p.body
	p.body = nil
	p.bodyMu.Unlock()
	if b != nil {
		_ = b.Close()
	}
}

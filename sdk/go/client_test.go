// SPDX-License-Identifier: Apache-2.0

package opendsec

// Unit tests against an httptest server standing in for the API's wire format; the
// tests against a real `dsec up` are in e2e_test.go.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func fakeAPI(t *testing.T, h http.HandlerFunc) *Client {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	c, err := New(WithAPIURL(srv.URL), WithAPIKey("dsk.test"))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestConfigComesFromTheFileDsecUpWrites(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "client.toml")
	if err := os.WriteFile(path, []byte("# written by dsec up\napi_url = \"http://127.0.0.1:7600/\"\napi_key = \"dsk.abc\\\"q\"\n[extra]\napi_key = \"no\"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("DSEC_API_URL", "")
	t.Setenv("DSEC_API_KEY", "")
	t.Setenv("DSEC_CONFIG", path)
	c, err := New()
	if err != nil {
		t.Fatal(err)
	}
	if c.apiURL != "http://127.0.0.1:7600" || c.apiKey != "dsk.abc\"q" {
		t.Fatalf("read url %q key %q", c.apiURL, c.apiKey)
	}
	// The environment comes before the file.
	t.Setenv("DSEC_API_KEY", "dsk.env")
	if c, err = New(); err != nil || c.apiKey != "dsk.env" {
		t.Fatalf("key %q err %v", c.apiKey, err)
	}
	// Nothing configured: the error says what to do.
	t.Setenv("DSEC_API_KEY", "")
	t.Setenv("DSEC_CONFIG", filepath.Join(dir, "missing.toml"))
	if _, err = New(); err == nil || !strings.Contains(err.Error(), "run `dsec up`") {
		t.Fatalf("no config gave %v", err)
	}
	if _, err = New(WithAPIURL("127.0.0.1:7600"), WithAPIKey("k")); err == nil {
		t.Fatal("a URL without a scheme was taken")
	}
}

func TestErrorAnswersBecomeTypedErrors(t *testing.T) {
	c := fakeAPI(t, func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer dsk.test" {
			t.Errorf("authorization %q", r.Header.Get("Authorization"))
		}
		switch r.URL.Path {
		case "/v1/sandboxes/gone":
			w.WriteHeader(404)
			fmt.Fprint(w, `{"code":"not_found","message":"no sandbox gone"}`)
		case "/v1/sandboxes/gone/exec":
			w.WriteHeader(429)
			fmt.Fprint(w, `{"code":"resource_exhausted","message":"quota"}`)
		default:
			w.WriteHeader(502)
			fmt.Fprint(w, "<html>bad gateway</html>")
		}
	})
	ctx := context.Background()
	_, err := c.GetSandbox(ctx, "gone")
	var e *Error
	if !errors.Is(err, ErrNotFound) || !errors.As(err, &e) || e.Status != 404 || e.Message != "no sandbox gone" {
		t.Fatalf("got %#v", err)
	}
	if errors.Is(err, ErrInvalidArgument) {
		t.Fatal("not_found matched invalid_argument")
	}
	_, err = c.Sandbox("gone").RunShell(ctx, "true")
	if !errors.Is(err, ErrResourceExhausted) {
		t.Fatalf("got %v", err)
	}
	// Stopping a sandbox that is gone is not an error.
	if err := c.Sandbox("gone").Stop(ctx); err != nil {
		t.Fatalf("stop of a gone sandbox: %v", err)
	}
	_, err = c.Status(ctx)
	if !errors.As(err, &e) || e.Code != "http_error" || e.Status != 502 || !strings.Contains(e.Message, "bad gateway") {
		t.Fatalf("got %#v", err)
	}
	// Exec needs exactly one of Argv and Cmd, refused before any request.
	if _, err := c.Sandbox("x").Exec(ctx, ExecOptions{}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("got %v", err)
	}
}

func TestAnExecStreamIsReadAsItComes(t *testing.T) {
	release := make(chan struct{})
	c := fakeAPI(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/x-ndjson")
		f := w.(http.Flusher)
		// Output may come before the start event; the reader keeps it.
		fmt.Fprint(w, `{"type":"stdout","data":"YQo="}`+"\n"+`{"type":"start","pid":7}`+"\n\n")
		fmt.Fprint(w, `{"type":"stderr","data":"ZXJyCg=="}`+"\n"+`{"type":"future","x":1}`+"\n")
		f.Flush()
		<-release
		fmt.Fprint(w, `{"type":"stdout","data":"Ygo="}`+"\n")
		fmt.Fprint(w, `{"type":"exit","exit_code":3,"duration_ms":5,"stderr_truncated":true}`+"\n")
	})
	p, err := c.Sandbox("s").ExecStream(context.Background(), ExecOptions{Cmd: "x"})
	if err != nil {
		t.Fatal(err)
	}
	if p.Pid != 7 {
		t.Fatalf("pid %d", p.Pid)
	}
	for _, want := range []Chunk{{"stdout", []byte("a\n")}, {"stderr", []byte("err\n")}} {
		got, err := p.Next()
		if err != nil || got.Stream != want.Stream || !bytes.Equal(got.Data, want.Data) {
			t.Fatalf("got %v %q, %v; want %v", got.Stream, got.Data, err, want)
		}
	}
	close(release)
	r, err := p.Wait()
	if err != nil {
		t.Fatal(err)
	}
	if r.ExitCode != 3 || r.Stdout != "a\nb\n" || r.Stderr != "err\n" || !r.StderrTruncated || r.DurationMs != 5 {
		t.Fatalf("result %+v", r)
	}
	if _, err := p.Next(); err != io.EOF {
		t.Fatalf("after the exit: %v", err)
	}
}

func TestStreamErrorsAndBreaks(t *testing.T) {
	c := fakeAPI(t, func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, `{"type":"start","pid":9}`+"\n")
		if r.URL.Query().Get("x") == "" && strings.HasSuffix(r.URL.Path, "/exec") {
			fmt.Fprint(w, `{"type":"error","code":"deadline_exceeded","message":"too slow"}`+"\n")
		}
		// The output route ends without an exit event.
	})
	p, err := c.Sandbox("s").ExecStream(context.Background(), ExecOptions{Argv: []string{"x"}})
	if err != nil {
		t.Fatal(err)
	}
	var e *Error
	if _, err := p.Wait(); !errors.As(err, &e) || e.Code != "deadline_exceeded" || e.Status != 504 {
		t.Fatalf("got %#v", err)
	}
	p, err = c.Sandbox("s").Attach(context.Background(), 9)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Wait(); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("a stream cut before the exit gave %v", err)
	}
}

func TestCancellingTheContextEndsAStream(t *testing.T) {
	c := fakeAPI(t, func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, `{"type":"start","pid":1}`+"\n")
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	})
	ctx, cancel := context.WithCancel(context.Background())
	p, err := c.Sandbox("s").ExecStream(ctx, ExecOptions{Cmd: "sleep 100"})
	if err != nil {
		t.Fatal(err)
	}
	time.AfterFunc(50*time.Millisecond, cancel)
	if _, err := p.Next(); !errors.Is(err, context.Canceled) {
		t.Fatalf("got %v", err)
	}
}

func TestWritesStreamWithTheirLengthModeAndMetadata(t *testing.T) {
	c := fakeAPI(t, func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		n, _ := io.Copy(io.Discard, r.Body)
		if r.Method != "PUT" || q.Get("path") != "/a b" || q.Get("mode") != "755" || q.Get("append") != "true" ||
			r.ContentLength != 5 || n != 5 || r.Header.Get("X-Dsec-Metadata-owner") != "me" {
			w.WriteHeader(400)
			fmt.Fprintf(w, `{"code":"invalid_argument","message":"%s %v %d %d %v"}`, r.Method, q, r.ContentLength, n, r.Header)
			return
		}
		fmt.Fprintf(w, `{"path":"/a b","size":%d}`, n)
	})
	w, err := c.Sandbox("s").Files().WriteFile(context.Background(), "/a b", []byte("hello"),
		&WriteOptions{Mode: 0o755, Append: true, Metadata: map[string]string{"owner": "me"}})
	if err != nil || w.Size != 5 {
		t.Fatalf("%+v %v", w, err)
	}
}

// FuzzProcessStream feeds arbitrary bytes to the output-stream reader: it must end with
// a result or an error, never panic or hang.
func FuzzProcessStream(f *testing.F) {
	f.Add([]byte(`{"type":"start","pid":1}` + "\n" + `{"type":"stdout","data":"YQ=="}` + "\n" + `{"type":"exit","exit_code":0}`))
	f.Add([]byte(`{"type":"stdout","data":"!!"}`))
	f.Add([]byte(`{"type":"error"}` + "\n"))
	f.Add([]byte("{\n\n["))
	f.Fuzz(func(t *testing.T, data []byte) {
		p := newProcess(context.Background(), &Sandbox{c: &Client{}}, 0, io.NopCloser(bytes.NewReader(data)))
		if err := p.waitStarted(); err != nil {
			return
		}
		r, err := p.Wait()
		if err == nil && r == nil {
			t.Fatal("no result and no error")
		}
	})
}

func TestEventQueriesAndWebhookChangesAreSentAsTheAPIReadsThem(t *testing.T) {
	var got []string
	c := fakeAPI(t, func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		got = append(got, r.Method+" "+r.URL.Path+"?"+r.URL.RawQuery+" "+string(body))
		if strings.HasPrefix(r.URL.Path, "/v1/webhooks/") {
			fmt.Fprint(w, `{"id":"wh-1","url":"https://example.com/h","project":"root","created_at_ms":1,"enabled":false,"format":"e2b"}`)
			return
		}
		fmt.Fprint(w, `{"events":[{"id":"e-9","seq":9,"type":"updated","at_ms":1,"sandbox":"s","project":"root","edge":"e","backend":"container"}],"next":9}`)
	})
	ctx := context.Background()
	evs, next, err := c.Events(ctx, EventsQuery{Types: []string{"stopped", "expired"}, NewestFirst: true, Offset: 5})
	if err != nil || next != 9 || len(evs) != 1 || evs[0].Type != "updated" {
		t.Fatalf("events %v next %d err %v", evs, next, err)
	}
	off := false
	w, err := c.UpdateWebhook(ctx, "wh-1", WebhookUpdate{Enabled: &off})
	if err != nil || w.Enabled || w.Format != "e2b" {
		t.Fatalf("webhook %+v err %v", w, err)
	}
	want := []string{
		"GET /v1/events?after=0&offset=5&order=desc&type=stopped&type=expired ",
		`PATCH /v1/webhooks/wh-1? {"enabled":false}`,
	}
	if len(got) != 2 || got[0] != want[0] || strings.TrimSpace(got[1]) != want[1] {
		t.Fatalf("sent %q, want %q", got, want)
	}
}

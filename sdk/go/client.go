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
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// maxAnswer bounds a JSON answer (listings of thousands of sandboxes stay far below it).
const maxAnswer = 256 << 20

// DefaultTimeout bounds a call that is not a stream when its context has no deadline.
const DefaultTimeout = 120 * time.Second

// Client talks to one OpenDsec API (a `dsec up` node or an apiserver). It is safe for
// use by many goroutines at once; make one and share it.
type Client struct {
	apiURL  string
	apiKey  string
	http    *http.Client
	timeout time.Duration
}

// Option sets up a Client made by New.
type Option func(*Client)

// WithAPIURL sets the API's URL (default: DSEC_API_URL, then client.toml).
func WithAPIURL(u string) Option { return func(c *Client) { c.apiURL = u } }

// WithAPIKey sets the API key (default: DSEC_API_KEY, then client.toml).
func WithAPIKey(k string) Option { return func(c *Client) { c.apiKey = k } }

// WithHTTPClient sends the requests through h (its Timeout should be 0: streams last as
// long as their process, and each call has its own deadline).
func WithHTTPClient(h *http.Client) Option { return func(c *Client) { c.http = h } }

// WithTimeout sets the deadline of a call that is not a stream when its context has none
// (default DefaultTimeout). Calls that wait for work (exec, fork, pause) add their own.
func WithTimeout(d time.Duration) Option { return func(c *Client) { c.timeout = d } }

// New makes a Client. The URL and key come from the options, else DSEC_API_URL and
// DSEC_API_KEY, else the file named by DSEC_CONFIG, else ~/.config/dsec/client.toml
// (written by `dsec up`).
func New(opts ...Option) (*Client, error) {
	c := &Client{timeout: DefaultTimeout}
	for _, o := range opts {
		o(c)
	}
	if c.apiURL == "" {
		c.apiURL = os.Getenv("DSEC_API_URL")
	}
	if c.apiKey == "" {
		c.apiKey = os.Getenv("DSEC_API_KEY")
	}
	if c.apiURL == "" || c.apiKey == "" {
		path := os.Getenv("DSEC_CONFIG")
		if path == "" {
			path = defaultConfigPath()
		}
		if path != "" {
			if conf, err := readClientConfig(path); err == nil {
				if c.apiURL == "" {
					c.apiURL = conf["api_url"]
				}
				if c.apiKey == "" {
					c.apiKey = conf["api_key"]
				}
			} else if !errors.Is(err, os.ErrNotExist) {
				return nil, fmt.Errorf("opendsec: reading %s: %w", path, err)
			}
		}
		if c.apiURL == "" || c.apiKey == "" {
			if path == "" {
				path = "~/.config/dsec/client.toml"
			}
			return nil, fmt.Errorf("opendsec: no API configured: run `dsec up` (it writes %s), "+
				"or set DSEC_API_URL and DSEC_API_KEY", path)
		}
	}
	u, err := url.Parse(c.apiURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("opendsec: the API URL %q is not an http:// or https:// URL", c.apiURL)
	}
	c.apiURL = strings.TrimRight(c.apiURL, "/")
	if c.http == nil {
		t := http.DefaultTransport.(*http.Transport).Clone()
		// Many goroutines share one client: keep their connections for reuse.
		t.MaxIdleConnsPerHost = 256
		c.http = &http.Client{Transport: t}
	}
	return c, nil
}

// APIURL is the URL the client sends its requests to.
func (c *Client) APIURL() string { return c.apiURL }

func defaultConfigPath() string {
	if x := os.Getenv("XDG_CONFIG_HOME"); x != "" {
		return filepath.Join(x, "dsec", "client.toml")
	}
	if h := os.Getenv("HOME"); h != "" {
		return filepath.Join(h, ".config", "dsec", "client.toml")
	}
	return ""
}

// readClientConfig reads the top-level `key = "value"` lines of a client.toml, the only
// shape `dsec up` writes.
func readClientConfig(path string) (map[string]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := map[string]string{}
	s := bufio.NewScanner(f)
	for s.Scan() {
		line := strings.TrimSpace(s.Text())
		if strings.HasPrefix(line, "[") {
			break // a table: the keys above it are the top level
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok || strings.HasPrefix(line, "#") {
			continue
		}
		v = strings.TrimSpace(v)
		if uq, err := strconv.Unquote(v); err == nil {
			v = uq
		} else if len(v) >= 2 && v[0] == '\'' && v[len(v)-1] == '\'' {
			v = v[1 : len(v)-1]
		}
		out[strings.TrimSpace(k)] = v
	}
	return out, s.Err()
}

// call sends a JSON request (body nil: none) and decodes a JSON answer into out (nil:
// the answer is dropped). wait is how long the server may take beyond the client's
// timeout (0: none), for calls that wait for work.
func (c *Client) call(ctx context.Context, method, path string, query url.Values, body, out any, wait time.Duration) error {
	if _, ok := ctx.Deadline(); !ok && c.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.timeout+wait)
		defer cancel()
	}
	var r io.Reader
	ct := ""
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return fmt.Errorf("opendsec: encoding the request: %w", err)
		}
		r, ct = bytes.NewReader(b), "application/json"
	}
	resp, err := c.send(ctx, method, path, query, r, ct, -1)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if out == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		return nil
	}
	// An answer is JSON of bounded size: a broken server cannot make this read forever.
	if err := json.NewDecoder(io.LimitReader(resp.Body, maxAnswer)).Decode(out); err != nil {
		return transportError(ctx, fmt.Sprintf("reading the answer to %s %s", method, path), err)
	}
	return nil
}

// send sends a request and returns the response of a success; an error status becomes
// an *Error. The caller closes the body. length -1: unknown (chunked).
func (c *Client) send(ctx context.Context, method, path string, query url.Values, body io.Reader,
	contentType string, length int64, extra ...http.Header) (*http.Response, error) {
	u := c.apiURL + path
	if len(query) > 0 {
		u += "?" + query.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, method, u, body)
	if err != nil {
		return nil, fmt.Errorf("opendsec: %s %s: %w", method, path, err)
	}
	if length >= 0 {
		req.ContentLength = length
	}
	req.Header.Set("Authorization", "Bearer "+c.apiKey)
	req.Header.Set("User-Agent", "opendsec-go")
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	for _, h := range extra {
		for k, v := range h {
			req.Header[k] = v
		}
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, transportError(ctx, fmt.Sprintf("%s %s", method, path), err)
	}
	if resp.StatusCode >= 400 {
		defer resp.Body.Close()
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		return nil, errorFromBody(resp.StatusCode, b)
	}
	return resp, nil
}

// transportError keeps a context's own error (canceled, deadline) as it is, so callers
// can test it with errors.Is; anything else is an "unavailable" *Error.
func transportError(ctx context.Context, what string, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("opendsec: %s: %w", what, ctx.Err())
	}
	return &Error{Status: 0, Code: "unavailable", Message: fmt.Sprintf("%s: %v", what, err), Err: err}
}

// --- the node and its sandboxes -----------------------------------------------------

// CreateSandbox starts a sandbox and returns once it runs.
func (c *Client) CreateSandbox(ctx context.Context, args RunArgs) (*Sandbox, error) {
	if args.Image == "" {
		args.Image = "root/base:latest"
	}
	var info SandboxInfo
	if err := c.call(ctx, "POST", "/v1/sandboxes", nil, args, &info, 10*time.Minute); err != nil {
		return nil, err
	}
	return &Sandbox{c: c, Info: info}, nil
}

// GetSandbox finds a sandbox by id (ErrNotFound if it is gone or not the key's).
func (c *Client) GetSandbox(ctx context.Context, id string) (*Sandbox, error) {
	var info SandboxInfo
	if err := c.call(ctx, "GET", "/v1/sandboxes/"+url.PathEscape(id), nil, nil, &info, 0); err != nil {
		return nil, err
	}
	return &Sandbox{c: c, Info: info}, nil
}

// Sandbox is a handle on a sandbox by id, without a request (its Info holds only the id
// until Refresh).
func (c *Client) Sandbox(id string) *Sandbox { return &Sandbox{c: c, Info: SandboxInfo{ID: id}} }

// ListSandboxes lists the key's sandboxes, those with all of labels when labels is set.
func (c *Client) ListSandboxes(ctx context.Context, labels map[string]string) ([]SandboxInfo, error) {
	q := url.Values{}
	for k, v := range labels {
		q.Add("label", k+"="+v)
	}
	var r struct {
		Sandboxes []SandboxInfo `json:"sandboxes"`
	}
	if err := c.call(ctx, "GET", "/v1/sandboxes", q, nil, &r, 0); err != nil {
		return nil, err
	}
	return r.Sandboxes, nil
}

// SandboxUsage is what one sandbox uses, from the node's last readings: CPUPercent (of
// one core, over the last reading interval) is nil before two readings or while paused.
type SandboxUsage struct {
	ID               string   `json:"id"`
	Project          string   `json:"project"`
	State            string   `json:"state"`
	Backend          string   `json:"backend"`
	Image            string   `json:"image"`
	CPUCores         float64  `json:"cpu_cores"`
	CPUPercent       *float64 `json:"cpu_percent,omitempty"`
	MemoryUsedBytes  uint64   `json:"memory_used_bytes"`
	MemoryLimitBytes uint64   `json:"memory_limit_bytes"`
	SampledAtMs      uint64   `json:"sampled_at_ms"`
}

// Usage says what each of the key's sandboxes (those with all of labels, when set) uses,
// in one call however many there are (what `dsec top` shows).
func (c *Client) Usage(ctx context.Context, labels map[string]string) ([]SandboxUsage, error) {
	q := url.Values{}
	for k, v := range labels {
		q.Add("label", k+"="+v)
	}
	var r struct {
		Sandboxes []SandboxUsage `json:"sandboxes"`
	}
	if err := c.call(ctx, "GET", "/v1/usage", q, nil, &r, 0); err != nil {
		return nil, err
	}
	return r.Sandboxes, nil
}

// Status is the node's (or cluster's) status as `dsec status --json` shows it.
func (c *Client) Status(ctx context.Context) (map[string]any, error) {
	var r map[string]any
	err := c.call(ctx, "GET", "/v1/status", nil, nil, &r, 0)
	return r, err
}

// --- snapshots ----------------------------------------------------------------------

// Snapshots lists the key's snapshots.
func (c *Client) Snapshots(ctx context.Context) ([]SnapshotInfo, error) {
	var r struct {
		Snapshots []SnapshotInfo `json:"snapshots"`
	}
	err := c.call(ctx, "GET", "/v1/snapshots", nil, nil, &r, 0)
	return r.Snapshots, err
}

// RestoreSnapshot starts count sandboxes from a snapshot, with labels over its own.
func (c *Client) RestoreSnapshot(ctx context.Context, snapshotID string, count int, labels map[string]string) ([]*Sandbox, error) {
	body := map[string]any{"count": count}
	if len(labels) > 0 {
		body["labels"] = labels
	}
	var r struct {
		Sandboxes []SandboxInfo `json:"sandboxes"`
	}
	if err := c.call(ctx, "POST", "/v1/snapshots/"+url.PathEscape(snapshotID)+"/restore", nil, body, &r, 15*time.Minute); err != nil {
		return nil, err
	}
	return c.sandboxes(r.Sandboxes), nil
}

// DeleteSnapshot deletes a snapshot.
func (c *Client) DeleteSnapshot(ctx context.Context, snapshotID string) error {
	return c.call(ctx, "DELETE", "/v1/snapshots/"+url.PathEscape(snapshotID), nil, nil, nil, 0)
}

// Images lists the images the key can start sandboxes from.
func (c *Client) Images(ctx context.Context) ([]map[string]any, error) {
	var r struct {
		Images []map[string]any `json:"images"`
	}
	err := c.call(ctx, "GET", "/v1/images", nil, nil, &r, 0)
	return r.Images, err
}

func (c *Client) sandboxes(infos []SandboxInfo) []*Sandbox {
	out := make([]*Sandbox, len(infos))
	for i, info := range infos {
		out[i] = &Sandbox{c: c, Info: info}
	}
	return out
}

// jsonReader is v encoded as JSON (a value that cannot be encoded becomes a body the
// server refuses with a clear error, which is never the case for this package's types).
func jsonReader(v any) io.Reader {
	b, err := json.Marshal(v)
	if err != nil {
		b = []byte(fmt.Sprintf("%q", err.Error()))
	}
	return bytes.NewReader(b)
}

// RemoveImage removes an image of the key's subtree and the layers nothing else uses.
func (c *Client) RemoveImage(ctx context.Context, reference string) error {
	return c.call(ctx, "DELETE", "/v1/images/"+url.PathEscape(reference), nil, nil, nil, 0)
}

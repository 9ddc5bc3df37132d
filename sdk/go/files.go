// SPDX-License-Identifier: Apache-2.0

package opendsec

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"os"
	"strconv"
)

// Files reaches a sandbox's files. Paths are absolute paths inside the sandbox.
type Files struct{ sb *Sandbox }

func (f *Files) base() string { return f.sb.base() + "/files" }

func pathQuery(path string) url.Values { return url.Values{"path": {path}} }

// Open streams a file's bytes: read them from the returned ReadCloser and close it.
// ErrNotFound if the file is missing, ErrInvalidArgument for a directory. ctx bounds the
// whole download.
func (f *Files) Open(ctx context.Context, path string) (io.ReadCloser, error) {
	resp, err := f.sb.c.send(ctx, "GET", f.base(), pathQuery(path), nil, "", -1)
	if err != nil {
		return nil, err
	}
	return &bodyReader{ctx: ctx, rc: resp.Body, what: "the download of " + path}, nil
}

// Read returns a file's bytes (for small files; Open streams large ones).
func (f *Files) Read(ctx context.Context, path string) ([]byte, error) {
	r, err := f.Open(ctx, path)
	if err != nil {
		return nil, err
	}
	defer r.Close()
	return io.ReadAll(r)
}

// WriteOptions are Write's optional settings.
type WriteOptions struct {
	// Mode is the new file's permission bits (e.g. 0o644); 0: the server's default.
	Mode os.FileMode
	// Append appends instead of replacing the file.
	Append bool
	// Size is r's length when known, sent as Content-Length (0: streamed in chunks).
	Size int64
	// Metadata replaces the file's metadata (lower-case keys, printable ASCII values);
	// without it a write clears the metadata and an append keeps it.
	Metadata map[string]string
}

// Write streams r into a file, creating its parent directories, in bounded memory.
// It returns the file's path and size.
func (f *Files) Write(ctx context.Context, path string, r io.Reader, o *WriteOptions) (*WriteResult, error) {
	q := pathQuery(path)
	length := int64(-1)
	var meta map[string]string
	if o != nil {
		if o.Mode != 0 {
			q.Set("mode", strconv.FormatUint(uint64(o.Mode.Perm()), 8))
		}
		if o.Append {
			q.Set("append", "true")
		}
		if o.Size > 0 {
			length = o.Size
		}
		meta = o.Metadata
	}
	h := http.Header{}
	for k, v := range meta {
		h.Set("X-Dsec-Metadata-"+k, v)
	}
	resp, err := f.sb.c.send(ctx, "PUT", f.base(), q, r, "application/octet-stream", length, h)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var w WriteResult
	if err := json.NewDecoder(resp.Body).Decode(&w); err != nil {
		return nil, transportError(ctx, "reading the answer to the upload of "+path, err)
	}
	return &w, nil
}

// WriteFile writes data to a file (see Write).
func (f *Files) WriteFile(ctx context.Context, path string, data []byte, o *WriteOptions) (*WriteResult, error) {
	opts := WriteOptions{}
	if o != nil {
		opts = *o
	}
	opts.Size = int64(len(data))
	if len(data) == 0 {
		opts.Size = 0
	}
	return f.Write(ctx, path, bytes.NewReader(data), &opts)
}

// WriteResult is a written file's path and size.
type WriteResult struct {
	Path string `json:"path"`
	Size uint64 `json:"size"`
}

// Stat describes a file (ErrNotFound if it is missing).
func (f *Files) Stat(ctx context.Context, path string) (*FileInfo, error) {
	var r FileInfo
	if err := f.sb.c.call(ctx, "GET", f.base()+"/stat", pathQuery(path), nil, &r, 0); err != nil {
		return nil, err
	}
	return &r, nil
}

// List lists a directory, depth levels down (1: its entries), sorted by path.
func (f *Files) List(ctx context.Context, path string, depth int) ([]FileInfo, error) {
	q := pathQuery(path)
	if depth > 0 {
		q.Set("depth", strconv.Itoa(depth))
	}
	var r struct {
		Entries []FileInfo `json:"entries"`
	}
	err := f.sb.c.call(ctx, "GET", f.base()+"/list", q, nil, &r, 0)
	return r.Entries, err
}

// Exists says whether path exists.
func (f *Files) Exists(ctx context.Context, path string) (bool, error) {
	var r struct {
		Exists bool `json:"exists"`
	}
	err := f.sb.c.call(ctx, "GET", f.base()+"/exists", pathQuery(path), nil, &r, 0)
	return r.Exists, err
}

// Mkdir makes a directory and its parents (like mkdir -p).
func (f *Files) Mkdir(ctx context.Context, path string) (*FileInfo, error) {
	return f.statCall(ctx, "/mkdir", map[string]any{"path": path})
}

// Remove removes a file or, with recursive, a directory tree.
func (f *Files) Remove(ctx context.Context, path string, recursive bool) error {
	return f.sb.c.call(ctx, "POST", f.base()+"/remove", nil, map[string]any{"path": path, "recursive": recursive}, nil, 0)
}

// Rename moves from to to.
func (f *Files) Rename(ctx context.Context, from, to string) (*FileInfo, error) {
	return f.statCall(ctx, "/rename", map[string]any{"from": from, "to": to})
}

// Chmod sets a file's permission bits.
func (f *Files) Chmod(ctx context.Context, path string, mode os.FileMode) (*FileInfo, error) {
	return f.statCall(ctx, "/chmod", map[string]any{"path": path, "mode": uint32(mode.Perm())})
}

// Chown sets a file's owner and group.
func (f *Files) Chown(ctx context.Context, path string, uid, gid int) (*FileInfo, error) {
	return f.statCall(ctx, "/chown", map[string]any{"path": path, "uid": uid, "gid": gid})
}

func (f *Files) statCall(ctx context.Context, path string, body any) (*FileInfo, error) {
	var r FileInfo
	if err := f.sb.c.call(ctx, "POST", f.base()+path, nil, body, &r, 0); err != nil {
		return nil, err
	}
	return &r, nil
}

// bodyReader turns a broken download into an "unavailable" *Error (or ctx's error).
type bodyReader struct {
	ctx  context.Context
	rc   io.ReadCloser
	what string
}

func (b *bodyReader) Read(p []byte) (int, error) {
	n, err := b.rc.Read(p)
	if err != nil && err != io.EOF {
		err = transportError(b.ctx, b.what, err)
	}
	return n, err
}

func (b *bodyReader) Close() error { return b.rc.Close() }

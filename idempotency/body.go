package idempotency

import (
	"bytes"
	"io"
	"net/http"
	"sync"
)

// bodyBuf is a keyed request's body, read whole into a buffer of bodyPool.
// The middleware alone holds the buffer: the handler gets a copy (lend),
// so a request answered without the handler (a replay, a conflict, a
// refusal) reads its body into a reused buffer and allocates nothing for it.
type bodyBuf struct {
	b []byte  // the body
	p *[]byte // its pooled buffer
}

var bodyPool = sync.Pool{New: func() any { return new([]byte) }}

// maxPooledBody bounds the buffers bodyPool keeps: a larger body's buffer
// is left to the garbage collector.
const maxPooledBody = 64 << 10

// readBody reads r to its end. contentLength (the request's, -1 if unknown)
// sizes the buffer when it is at most limit; a body that turns out larger
// or smaller is read all the same.
func readBody(r io.Reader, contentLength, limit int64) (bodyBuf, error) {
	p := bodyPool.Get().(*[]byte)
	b := (*p)[:0]
	if contentLength >= 0 && contentLength <= limit && int64(cap(b)) <= contentLength {
		b = make([]byte, 0, contentLength+1) // +1: room to see EOF without growing
	}
	for {
		if len(b) == cap(b) {
			b = append(b, 0)[:len(b)]
		}
		n, err := r.Read(b[len(b):cap(b)])
		b = b[:len(b)+n]
		if err == io.EOF {
			*p = b
			return bodyBuf{b: b, p: p}, nil
		}
		if err != nil {
			*p = b
			bodyBuf{p: p}.free()
			return bodyBuf{}, err
		}
	}
}

// free returns the buffer to the pool; the body must not be used after.
func (body bodyBuf) free() {
	if cap(*body.p) > maxPooledBody {
		return
	}
	*body.p = (*body.p)[:0]
	bodyPool.Put(body.p)
}

// lend makes r's body a copy of the body that the handler can read (and
// get again through GetBody), and frees the buffer.
func (body bodyBuf) lend(r *http.Request) {
	b := bytes.Clone(body.b)
	body.free()
	r.Body = newBodyReader(b)
	r.GetBody = func() (io.ReadCloser, error) { return newBodyReader(b), nil }
	r.ContentLength = int64(len(b))
}

// bodyReader is a request body read from memory.
type bodyReader struct{ bytes.Reader }

func newBodyReader(b []byte) *bodyReader {
	br := new(bodyReader)
	br.Reset(b)
	return br
}

func (*bodyReader) Close() error { return nil }

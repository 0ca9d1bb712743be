package testenv

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl/scram"
)

// SASL users of a SecureKafka: one per SCRAM mechanism.
const (
	SCRAM256User = "alice"
	SCRAM512User = "bob"
)

// SecureKafka is an in-process kfake cluster that accepts only TLS
// connections (a certificate made for the test, for 127.0.0.1 and
// localhost) authenticated with SASL SCRAM.
type SecureKafka struct {
	*Kafka
	CAFile    string // PEM of the certificate to trust
	Passwords map[string]string
}

// NewSecureKafka starts a SecureKafka; its Kafka.ClientOpts (TLS trusting
// CAFile, SCRAM-SHA-512 as SCRAM512User) let test clients in. It is always
// in-process, whatever KAFKA_BROKERS says.
func NewSecureKafka(t testing.TB, opts ...kfake.Opt) *SecureKafka {
	t.Helper()
	certPEM, cert := selfSignedCert(t)
	caFile := filepath.Join(t.TempDir(), "kafka-ca.pem")
	if err := os.WriteFile(caFile, certPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	passwords := map[string]string{SCRAM256User: "pw-" + UniqueName("a"), SCRAM512User: "pw-" + UniqueName("b")}
	c, err := kfake.NewCluster(append([]kfake.Opt{
		kfake.NumBrokers(1),
		kfake.TLS(&tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}),
		kfake.EnableSASL(),
		kfake.Superuser("SCRAM-SHA-256", SCRAM256User, passwords[SCRAM256User]),
		kfake.Superuser("SCRAM-SHA-512", SCRAM512User, passwords[SCRAM512User]),
	}, opts...)...)
	if err != nil {
		t.Fatalf("testenv: start kfake with TLS and SASL: %v", err)
	}
	t.Cleanup(c.Close)
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(certPEM)
	clientOpts := []kgo.Opt{
		kgo.DialTLSConfig(&tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}),
		kgo.SASL(scram.Auth{User: SCRAM512User, Pass: passwords[SCRAM512User]}.AsSha512Mechanism()),
	}
	return &SecureKafka{
		Kafka:     &Kafka{Brokers: c.ListenAddrs(), Cluster: c, ClientOpts: clientOpts},
		CAFile:    caFile,
		Passwords: passwords,
	}
}

// selfSignedCert returns a self-signed certificate for 127.0.0.1 and
// localhost, valid for a day, in PEM and ready to serve.
func selfSignedCert(t testing.TB) ([]byte, tls.Certificate) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(time.Now().UnixNano()),
		Subject:               pkix.Name{CommonName: "oncely test kafka"},
		NotBefore:             time.Now().Add(-time.Minute),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
		IPAddresses:           []net.IP{net.IPv4(127, 0, 0, 1)},
		DNSNames:              []string{"localhost"},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := tls.X509KeyPair(certPEM, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}))
	if err != nil {
		t.Fatal(err)
	}
	return certPEM, cert
}

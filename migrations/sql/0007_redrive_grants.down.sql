DROP TABLE redrive_grants;
